"""``shrink_group``: a group without some of its ranks, torch's call on MPI.

torch 2.13's ``dist.shrink_group(ranks_to_exclude, group=None, shrink_flags=SHRINK_DEFAULT,
pg_options=None)``: only the ranks that stay call it; the new group's ranks are the old
ones' in order, without the excluded; shrinking the default group renumbers the ranks,
makes the new group the default one and ends every other group (their ranks would
mean nothing any more).  The old group ends on this rank without waiting for any other.

How the stayers' communicator is made:

- **A rank died** (an MPI with ULFM): the survivors agreed on the dead once, on WORLD
  (``spmd.runtime.failures.agree``, run here too if this rank has not met the failure
  yet), which gave WORLD's survivors a communicator.  Shrinking WORLD by exactly the
  dead takes it as it is; any other shrink is a ``Create_group`` of it that only the
  stayers call.  ``ranks_to_exclude`` must hold every dead member of the group.
- **No rank died** (a planned removal, any MPI): ``Create_group`` of the group's
  communicator, which only the stayers call.
- **Without ULFM, a group broken by a timeout**: a member may be dead, and nothing on
  this MPI can build a communicator that does not wait for it; the error says so and
  what MPI would.

``SHRINK_ABORT`` is accepted as in torch; there is nothing more to abort here: spmd's
blocking ops on this rank have returned when it calls shrink_group, and after a death
the agreement has revoked every group already (the group's pending Works raise).
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from spmd.backends.mpi import faults
from spmd.core.errors import located
from spmd.runtime import exits, failures, hangs, supervision
from spmd.runtime.group import (
    GroupMember,
    ProcessGroup,
    default_group,
    register_group,
    world_state,
)
from spmd.runtime.reliability import state

__all__ = ["SHRINK_DEFAULT", "SHRINK_ABORT", "shrink_group", "get_failed_ranks",
           "fault_tolerant"]

SHRINK_DEFAULT = 0x00
SHRINK_ABORT = 0x01   # torch's flag; see the module docstring

_OP = "shrink_group"


def fault_tolerant() -> bool:
    """Whether this job survives a dead rank: its MPI has ULFM that works (Open MPI 5
    under ``mpiexec --with-ft ulfm``).  Elsewhere a dead rank ends the job with a
    diagnosis, and :func:`shrink_group` serves planned removals only."""
    return faults.ulfm()


def get_failed_ranks(group: ProcessGroup | None = None) -> list[int]:
    """The ranks of ``group`` (group ranks, what :func:`shrink_group` takes) that died.

    After a ProcessFailedError on the group this is the survivors' agreed set, the same
    on every survivor; before, what MPI has told this rank so far (it may know fewer
    than another survivor).  Always empty on an MPI without ULFM.
    """
    pg = default_group("get_failed_ranks") if group is None else group
    if not isinstance(pg, ProcessGroup):
        raise TypeError(f"get_failed_ranks: group must be a ProcessGroup or None, got "
                        f"{type(pg).__name__}")
    ctx = pg.context
    dead = ctx.failed if ctx.failed is not None else faults.known_failed(ctx)
    return sorted(ctx.index[g] for g in dead if g in ctx.index)


def _check_arguments(ranks_to_exclude: Any, shrink_flags: Any, pg: ProcessGroup) -> list[int]:
    """torch's checks, in torch's order and with its exception types; this library's
    message form (op, argument, expected vs got, rank, group)."""
    ctx = pg.context
    if not isinstance(ranks_to_exclude, list):
        raise located(TypeError, _OP, f"ranks_to_exclude must be a list of group ranks, got "
                      f"{type(ranks_to_exclude).__name__}", ctx)
    if not ranks_to_exclude:
        raise located(ValueError, _OP, "ranks_to_exclude is empty; name at least one rank to "
                      "exclude (e.g. the failed ranks: spmd.get_failed_ranks(group))", ctx)
    if not isinstance(shrink_flags, int) or shrink_flags not in (SHRINK_DEFAULT, SHRINK_ABORT):
        raise located(ValueError, _OP, f"shrink_flags must be SHRINK_DEFAULT ({SHRINK_DEFAULT}) "
                      f"or SHRINK_ABORT ({SHRINK_ABORT}), got {shrink_flags!r}", ctx)
    if ctx.size <= 1:
        raise located(ValueError, _OP, f"cannot shrink a group of size {ctx.size}; it needs "
                      "at least 2 ranks", ctx)
    seen: list[int] = []
    for i, r in enumerate(ranks_to_exclude):
        if not isinstance(r, int):   # as torch: a bool is an int
            raise located(TypeError, _OP, f"ranks_to_exclude[{i}] must be an int, got "
                          f"{type(r).__name__}: {r!r}", ctx)
        if not 0 <= r < ctx.size:
            raise located(ValueError, _OP, f"ranks_to_exclude[{i}] = {r} is out of range "
                          f"[0, {ctx.size - 1}] (group ranks)", ctx)
        if r in seen:
            raise located(ValueError, _OP, f"ranks_to_exclude[{i}] = {r} is listed twice", ctx)
        seen.append(r)
    if len(seen) >= ctx.size:
        raise located(ValueError, _OP, f"cannot exclude all {ctx.size} ranks; at least one "
                      "must stay", ctx)
    if ctx.rank in seen:
        raise located(RuntimeError, _OP, f"this rank ({ctx.rank}) is in ranks_to_exclude; "
                      "only the ranks that stay call shrink_group", ctx)
    return sorted(seen)


def _stayers_comm(pg: ProcessGroup, excluded: list[int]) -> MPI.Intracomm:
    """The communicator of the group's ranks that stay (see the module docstring)."""
    ctx = pg.context
    ulfm = faults.ulfm()
    world = world_state.world
    assert world is not None   # default_group() found it
    if ulfm and (ctx.failed is not None or failures.known_dead or ctx.comm.Is_revoked()
                 or faults.known_failed(world.context)):
        dead = failures.agree()
        if dead:
            return _from_survivors(pg, excluded, dead)
    gone = exits.exited_members(ctx)
    if gone and set(gone) <= set(excluded):
        # Members that exited sit in MPI_Finalize: a group of the others needs only them.
        return _create_group(ctx.comm, excluded)
    if ctx.error is not None:
        why = ("" if ulfm else "; if a member died, going on without it needs an MPI with "
               f"ULFM: {faults.ulfm_missing()}")
        raise located(RuntimeError, _OP, f"group {ctx.name} is broken since {ctx.error}, "
                      f"and nothing shows that a member died{why}", ctx)
    return _create_group(ctx.comm, excluded)


def _from_survivors(pg: ProcessGroup, excluded: list[int],
                    dead: tuple[int, ...]) -> MPI.Intracomm:
    """After the agreement: the stayers' communicator, made from WORLD's survivors'."""
    ctx = pg.context
    dead_here = sorted(ctx.index[g] for g in dead if g in ctx.index)
    missing = [r for r in dead_here if r not in excluded]
    if missing:
        raise located(ValueError, _OP, f"group ranks {missing} died, so ranks_to_exclude must "
                      f"hold them; got {excluded} (spmd.get_failed_ranks(group) gives "
                      f"{dead_here})", ctx)
    live = failures.survivors()
    assert live is not None   # the agreement made it
    world = world_state.world
    assert world is not None
    alive = [g for g in world.context.ranks if g not in dead]   # the survivors' order
    stay = {g for i, g in enumerate(ctx.ranks) if i not in excluded}
    if pg is world and stay == set(alive):
        return live   # WORLD without exactly the dead: the agreement's communicator
    return _create_group(live, [i for i, g in enumerate(alive) if g not in stay])


def _create_group(comm: MPI.Intracomm, drop: list[int]) -> MPI.Intracomm:
    """``comm`` without the ranks ``drop``: only the others call it."""
    group = comm.Get_group()
    stay = group.Excl(drop)
    group.Free()
    try:
        return comm.Create_group(stay)
    finally:
        stay.Free()


def shrink_group(ranks_to_exclude: list[int], group: ProcessGroup | None = None,
                 shrink_flags: int = SHRINK_DEFAULT, pg_options: object = None) -> ProcessGroup:
    """A new group of ``group``'s ranks without ``ranks_to_exclude`` (torch's call).

    Only the ranks that stay call it, all with the same arguments.  Shrinking the
    default group makes the new group the default one, renumbers the ranks (the new
    ``get_rank()`` is the rank among the stayers) and ends every other group; shrinking
    another group ends that one.  An ended group raises at its next use.

    Args:
        ranks_to_exclude: group ranks to leave out (after a ProcessFailedError: its
            ``group_ranks``, or :func:`get_failed_ranks`); every dead member must be in it.
        group: the group to shrink (the default group if None); a group a member of
            died is what this is for.
        shrink_flags: ``SHRINK_DEFAULT`` or ``SHRINK_ABORT`` (torch's; the same here,
            see the module docstring).
        pg_options: accepted for torch's signature; spmd's groups take no options.

    Returns:
        The new group.

    Raises:
        TypeError, ValueError: bad arguments (torch's checks), before anything is sent.
        RuntimeError: this rank is excluded; or the group is broken by a timeout on an
            MPI without ULFM, where nothing can be built without a member that may be
            dead (the message says what MPI can).
    """
    pg = default_group(_OP) if group is None else group
    if not isinstance(pg, ProcessGroup):
        raise TypeError(f"{_OP}: group must be a ProcessGroup or None, got {type(pg).__name__}")
    if pg.context.comm is None:
        raise RuntimeError(f"{_OP}: group {pg.context.name} was destroyed")
    excluded = _check_arguments(ranks_to_exclude, shrink_flags, pg)
    ctx = pg.context
    comm = _stayers_comm(pg, excluded)
    stay = [g for i, g in enumerate(ctx.ranks) if i not in excluded]
    if pg is world_state.world:
        return _new_world(pg, comm, stay)
    new = register_group(comm, stay, f"{ctx.name}:shrunk", ctx.timeout, ctx.backend_name,
                         f"{ctx.desc}:shrunk")
    pg.abort()
    if pg in world_state.groups:
        world_state.groups.remove(pg)
    return new


def _new_world(old: ProcessGroup, comm: MPI.Intracomm, stay: list[int]) -> ProcessGroup:
    """The default group becomes ``comm``'s (the processes of ranks ``stay``, in order):
    every group ends, the ranks are renumbered, the watchdog and control channel start
    again on the new world."""
    ctx = old.context
    supervision.stop()
    hangs.renumber(stay)
    for pg in reversed(world_state.groups):
        pg.abort()
    failures.reset()   # the dead ranks' numbers mean nothing in the new numbering
    exits.reset()
    comm.Set_name(f"spmd:{ctx.name}")
    new = ProcessGroup(comm, range(comm.Get_size()), ctx.name, ctx.timeout, ctx.backend_name,
                       desc="default:shrunk", store=world_state.store)
    world_state.world = new
    world_state.groups = [new]
    GroupMember.WORLD = new
    supervision.start(new, state.config, _OP)
    return new
