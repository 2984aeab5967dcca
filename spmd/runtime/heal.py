"""Healing: the survivors of failures bring WORLD back to its full size, with its state.

``shrink_group`` keeps a job alive without its lost ranks; :func:`heal` gives it back its
capacity.  Every member of the (shrunk) default group calls it; together they start one
new process per lost rank, running this same program (``MPI_Comm_spawn`` from the
default group's communicator), merge with them and renumber, so that the new processes
hold the ranks the lost ones held and every survivor its rank from before the failures
(:mod:`spmd.backends.mpi.replacement` has the new processes' side).  Every other group ends,
as when shrinking WORLD; layouts rebuilt afterwards (a DeviceMesh, parallel_state) are
the ones from before, and their NCCL communicators are made anew.

In a new process, ``init_process_group()`` joins that world and
:func:`is_replacement` is True.  The program's state comes from a live peer, never from
disk unless the program asks: :func:`heal_state`, one collective on the healed world.

A training loop that survives ranks lost, killed or hung, any number of times and during
a recovery too (under ULFM: Open MPI's ``mpiexec --with-ft ulfm``)::

    def recover(state, joining=False):
        while True:
            try:
                if not joining:
                    dist.shrink_group(dist.get_failed_ranks())   # the survivors' world
                    dist.heal()                                  # back to full size
                return dist.heal_state(state)                    # the new ones get it
            except (dist.ProcessFailedError, dist.GroupBrokenError):
                joining = False                                  # lost another: again

    dist.init_process_group()
    state = recover(None, joining=True) if dist.is_replacement() else make_state()
    while state["step"] < steps:
        try:
            train_step(state)                      # collectives on WORLD
        except (dist.ProcessFailedError, dist.GroupBrokenError):
            state = recover(state)

Where the new processes run is the launcher's choice (Open MPI places them on the slots
the job has; the lost processes' slots are free again).  Starting them takes a Python
interpreter's start-up, imports and ``MPI_Init`` (docs/reliability.md has the figures).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, cast

from mpi4py import MPI
from mpi4py.util import pkl5

from spmd.backends import setup
from spmd.backends.mpi import faults, recoverable_spawn, replacement
from spmd.core.context import GroupContext
from spmd.core.errors import located
from spmd.runtime import exits, failures, supervision
from spmd.runtime.abort import abort_job
from spmd.runtime.diagnosis import RECOVERY, RECOVERY_PATIENCE
from spmd.runtime.group import ProcessGroup, default_group, world_state
from spmd.runtime.reliability import report
from spmd.runtime.reliability import state as reliability_state
from spmd.runtime.world import end_healed_world_at_exit, open_world

__all__ = ["close_port", "heal", "heal_state", "is_replacement", "last_heal", "open_port",
           "regroup_world", "replace_world", "spawn_peers"]

_OP = "heal"

# How the last heal went on this process (seconds by step), for programs that report it.
last_heal: dict[str, float] = {}


def is_replacement() -> bool:
    """True in a process ``heal()`` started to take a lost rank's place (from its
    ``init_process_group()`` on), until it itself takes part in a later heal."""
    return world_state.is_replacement


def _command() -> tuple[str, list[str]]:
    """This program as the interpreter was asked to run it: the executable and the
    arguments after it (``-m module``, ``-c code``, options and all)."""
    return sys.executable, list(sys.orig_argv[1:])


def _start_processes(ctx: GroupContext, count: int, what: str, op: str) -> MPI.Intercomm:
    """``count`` new processes running this program, started together by every member
    of the default group: the intercommunicator to them.  Under ULFM on Open MPI they
    are a recoverable job (:mod:`spmd.backends.mpi.recoverable_spawn`: their death later
    does not fail the launcher); elsewhere ``MPI_Comm_spawn`` starts them."""
    exe, args = _command()
    if faults.ulfm() and recoverable_spawn.available():
        return _start_recoverable(ctx, count, what, op, [exe, *args])
    info = MPI.Info.Create()
    info.Set("wdir", os.getcwd())   # a relative script path resolves as it did at start
    if faults.ulfm():
        # Open MPI's key (PMIx's) for the new processes' environment: their MPI library
        # survives failures too (mpiexec --with-ft ulfm set it for the ranks it started).
        info.Set("PMIX_ENVAR", "OMPI_MCA_mpi_ft_enable=1")
    try:
        return ctx.comm.Spawn(exe, args=args, maxprocs=count, info=info, root=0)
    except MPI.Exception as exc:
        raise located(RuntimeError, op, f"MPI could not start {count} process(es) {what}: "
                      f"{exc.Get_error_string()}", ctx) from exc
    finally:
        info.Free()


# How long the group's rank 0 waits for the processes it started to connect before it
# starts others in their place (one may have died before it joined), and how many times.
JOIN_SECONDS = 10.0
JOIN_TRIES = 3


def _start_recoverable(ctx: GroupContext, count: int, what: str, op: str,
                       argv: list[str]) -> MPI.Intercomm:
    """The new processes as a recoverable job: rank 0 opens a port and starts them, all
    accept their connection (a member lost meanwhile raises its failure on the others;
    the accept itself, which Open MPI does through a PMIx_Connect that waits for every
    participant, stays blocked on its thread, and the new processes it was for leave
    after ``ABANDONED_SECONDS``: spmd.backends.mpi.replacement).  Processes that never
    connect (dead before they joined) are replaced by others on the same port; after
    :data:`JOIN_TRIES` the job ends with the diagnosis rather than wait forever."""
    comm = ctx.comm
    port = MPI.Open_port() if ctx.rank == 0 else ""

    def start() -> None:
        recoverable_spawn.spawn(count, port, argv, {})

    refused = None
    if ctx.rank == 0:
        try:
            start()
        except RuntimeError as exc:
            refused = str(exc)
    refused = comm.bcast(refused, 0)   # MPI's errors: the caller's (a failure: retried)
    if refused is not None:
        if ctx.rank == 0:
            MPI.Close_port(port)
        raise located(RuntimeError, op, f"could not start {count} process(es) {what}: "
                      f"{refused}", ctx)
    # On this thread: Open MPI's accept cannot be left behind on another one (a second
    # accept beside a blocked one corrupted its heap); the watch ends the job instead.
    rescue = _Rescue(start if ctx.rank == 0 else None, count, what, op, ctx)
    try:
        return comm.Accept(port, root=0)
    finally:
        rescue.done.set()
        if ctx.rank == 0:
            MPI.Close_port(port)


def _timed(ctx: GroupContext, what: str, fn, seconds: float | None = None, op: str = _OP):
    """A blocking step of a recovery, under the group's timeout (or ``seconds``): a
    member lost meanwhile raises its failure, a silent one is taken for hung
    (spmd.backends.setup.run_blocking); with every member there, it waits on."""
    return setup.run_blocking(ctx, op, f"healing: {what}", fn,
                              ctx.timeout if seconds is None else seconds, kind=RECOVERY,
                              patience=RECOVERY_PATIENCE)


class _Rescue:
    """Every member's watch over the accept of a recoverable start.  Open MPI's
    ``MPI_Comm_accept`` waits in a PMIx_Connect for every member, which nothing ends:
    a member found dead meanwhile (MPI's failed ranks) ends the job with the diagnosis
    rather than leave the others there forever.  On rank 0 (``start`` given), new
    processes that have not connected after :data:`JOIN_SECONDS` are started again;
    after :data:`JOIN_TRIES` starts the job ends."""

    def __init__(self, start, count: int, what: str, op: str, ctx: GroupContext) -> None:
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(start, count, what, op, ctx),
                                        name="spmd-heal-rescue", daemon=True)
        self._thread.start()

    def _watch(self, start, count: int, what: str, op: str, ctx: GroupContext) -> None:
        where = f"[rank {ctx.rank}, group {ctx.name}]"
        began, tries = time.monotonic(), 1
        while not self.done.wait(0.2):
            dead = list(faults.known_failed(ctx))
            if dead:
                abort_job(f"spmd: {op}: rank(s) {dead} died while the survivors accepted the "
                          f"{count} process(es) started {what}; Open MPI's accept cannot "
                          f"complete without them, so the job ends here {where}")
            if start is None or time.monotonic() - began < JOIN_SECONDS:
                continue
            if tries >= JOIN_TRIES:
                abort_job(f"spmd: {op}: none of {JOIN_TRIES} starts of {count} process(es) "
                          f"{what} connected within {JOIN_SECONDS:g} s each; ending the job "
                          f"rather than wait forever {where}")
            tries += 1
            report(f"spmd: {op}: the {count} process(es) started {what} did not connect within "
                   f"{JOIN_SECONDS:g} s (dead before they joined?): starting others in their "
                   f"place (start {tries} of {JOIN_TRIES})")
            try:
                start()
            except RuntimeError as exc:
                report(f"spmd: {op}: {exc}")
            began = time.monotonic()


def replace_world(comm: MPI.Intracomm, replaced: tuple[int, ...] = ()) -> ProcessGroup:
    """Make ``comm`` the default group in place of this process's world (every process
    of ``comm`` calls it).  The old world ends here, as when shrinking it: its groups,
    the watchdog, the control channel; then the new one opens.

    Args:
        comm: the new world's communicator (spmd's own from now on).
        replaced: the ranks in it that processes started for it took.
    """
    ctx = default_group("replace_world").context
    supervision.stop()
    for group in reversed(world_state.groups):
        group.abort()
    failures.reset()
    exits.reset()
    world_state.replaced = replaced
    world_state.is_replacement = False
    pg = open_world(comm, ctx.name, ctx.timeout, ctx.backend_name, world_state.store,
                    reliability_state.config, _OP)
    end_healed_world_at_exit()
    return pg


def heal(timeout: float | None = None) -> list[int]:
    """Bring the default group back to the size it was made with.

    Every member of the default group calls it, after ``shrink_group`` (or failures)
    left it smaller.  New processes run this program; in them ``init_process_group()``
    joins the world, taking the ranks the lost processes held.  Every other group ends.

    Args:
        timeout: accepted for symmetry with the other calls; starting processes waits
            for MPI (``MPI_Comm_spawn`` cannot be timed out).

    Returns:
        The ranks the new processes took (empty if the world was whole).

    Raises:
        RuntimeError: not initialised, or MPI could not start the processes.
    """
    del timeout
    pg = default_group(_OP)
    ctx = pg.context
    full, me = world_state.full_size, world_state.home_rank
    t0 = time.monotonic()
    for attempt in range(1, JOIN_TRIES + 1):
        try:
            homes = _timed(ctx, "the survivors' ranks", lambda: ctx.comm.allgather(me))
        except MPI.Exception as exc:
            raise faults.failure(exc, _OP, ctx) from exc
        lost = sorted(set(range(full)) - set(homes))
        if not lost:
            return []
        comm, t_spawn, t_merge = _join_new_processes(ctx, full, me, lost)
        if comm is not None:
            break
        # A new process died on the way (the survivors agreed that all of them are
        # here): start the lost ranks' processes again.
        report(f"spmd: {_OP}: a process started for ranks {lost} died before the world was "
               f"whole (start {attempt} of {JOIN_TRIES})")
    else:
        raise located(RuntimeError, _OP, f"the processes started for ranks {lost} died "
                      f"before the world was whole, {JOIN_TRIES} times", ctx)
    replace_world(comm, tuple(lost))
    last_heal.clear()
    last_heal.update(spawn=t_spawn - t0, merge=t_merge - t_spawn,
                     open=time.monotonic() - t_merge, total=time.monotonic() - t0)
    return lost


def _join_new_processes(ctx: GroupContext, full: int, me: int, lost: list[int]
                        ) -> tuple[MPI.Intracomm | None, float, float]:
    """Start processes for ``lost``, merge with them and renumber: the healed world's
    communicator; None where a new process died on the way.  The survivors agree on the
    outcome (``MPI_Comm_agree`` on the world), so all of them retry or none; a survivor
    lost on the way raises ProcessFailedError on all (the program shrinks again)."""
    made: list[MPI.Comm] = []
    comm = None
    try:
        inter = _start_processes(ctx, len(lost), f"for ranks {lost}", _OP)
        made.append(inter)
        t_spawn = time.monotonic()
        merged = _timed(ctx, "merging with the new processes", lambda: inter.Merge(high=False))
        made.append(merged)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        plan = replacement.HealPlan(full, tuple(lost), ctx.name)
        _timed(ctx, "the plan", lambda: replacement.send_plan(merged, plan))
        comm = _timed(ctx, "renumbering", lambda: replacement.regroup(merged, me))
        ok = True
    except MPI.Exception as exc:
        if not faults.is_failure(exc) and not faults.ulfm():
            raise located(RuntimeError, _OP, f"MPI could not join the processes started for "
                          f"ranks {lost}: {exc.Get_error_string()}", ctx) from exc
        for c in made:
            faults.revoke(c)   # the new processes' side of it fails too
        ok, t_spawn = False, time.monotonic()
    except BaseException:
        for c in made:
            faults.revoke(c)   # a survivor lost or hung (its failure raised): as above
        raise
    t_merge = time.monotonic()
    try:
        everyone = _timed(ctx, "agreeing on the outcome", lambda: ctx.comm.Agree(int(ok)))
    except MPI.Exception as exc:
        raise faults.failure(exc, _OP, ctx) from exc
    for c in made:
        with contextlib.suppress(MPI.Exception):
            c.Free()
    if not everyone:
        if comm is not None:
            with contextlib.suppress(MPI.Exception):
                comm.Free()
        return None, t_spawn, t_merge
    return comm, t_spawn, t_merge


def heal_state(state: Any, src: int | None = None) -> Any:
    """Hand the program's state to the processes the last :func:`heal` started.

    Every rank of the healed default group calls it: the survivors with their state (a
    dict of arrays, a torch ``state_dict``, the step...), the new processes with
    anything (``None``).  Every rank gets ``src``'s state back (by default the lowest
    rank that holds it: not a new process), so all continue from the same one.  The
    state travels pickled: only between the job's own processes.

    A rank lost meanwhile raises ProcessFailedError on every rank, new processes
    included: all shrink, heal and call it again (a new process still waiting for the
    state passes ``None`` again; it is never the source).

    Returns:
        ``src``'s state.
    """
    pg = default_group("heal_state")
    ctx = pg.context
    try:
        # Who holds the state: not a new process, of this heal or of an earlier one
        # whose heal_state a failure interrupted.
        mine = not world_state.awaiting_state
        holders = [r for r, has in enumerate(_timed(ctx, "who holds the state",
                                                    lambda: ctx.comm.allgather(mine),
                                                    op="heal_state")) if has]
    except MPI.Exception as exc:
        raise faults.failure(exc, "heal_state", ctx) from exc
    new = [r for r in range(ctx.size) if r not in holders]
    if not holders:
        raise located(RuntimeError, "heal_state", "no process of the world holds the state: "
                      "every one that had it was lost", ctx)
    if src is None:
        src = holders[0]
    elif src not in holders:
        raise located(ValueError, "heal_state", f"src={src} is a new process: it has no "
                      f"state to give (new: {new})", ctx)
    try:
        # pkl5: out-of-band buffers, so arrays travel without a copy into the pickle and
        # past MPI's 2 GiB count.
        out = _timed(ctx, "the state", lambda: pkl5.Intracomm(ctx.comm).bcast(state, root=src),
                     op="heal_state")
    except MPI.Exception as exc:
        raise faults.failure(exc, "heal_state", ctx) from exc
    world_state.awaiting_state = False
    return out


# -- growing by processes that join later (torch's reconfigure: spmd.torch) ----------
#
# heal() starts processes and merges with them at once.  torch's reconfigure asks for the
# other order: processes exist first, each gives a handle, and a later call rebuilds the
# group on the processes whose handles it is given.  Two ways reach a new process: the
# link of processes started by the world (spawn_peers), and a port a process started by
# someone else opened (open_port: MPI_Comm_accept there, MPI_Comm_connect here).

def spawn_peers(count: int, extra: dict[str, Any]) -> str:
    """Start ``count`` processes running this program that join the world later.

    Every member of the default group calls it.  In the new processes
    ``init_process_group()`` opens a world of their own (they are its ranks, in their
    order); ``extra`` reaches them (``replacement.joined_as_peer()``).

    Returns:
        The id of the link to them, for :func:`regroup_world`.
    """
    pg = default_group("spawn_peers")
    ctx = pg.context
    if count < 1:
        raise located(ValueError, "spawn_peers", f"count must be at least 1, got {count}", ctx)
    inter = _start_processes(ctx, count, "to join later", "spawn_peers")
    merged = inter.Merge(high=False)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    return replacement.send_peer_plan(merged, ctx.name, extra)


def open_port() -> str:
    """An MPI port name on which this process can accept a connection (a local call)."""
    return MPI.Open_port()


def close_port(port: str) -> None:
    """Close a port :func:`open_port` opened."""
    MPI.Close_port(port)


def regroup_world(steps: Sequence[tuple[str, str]], key: int) -> ProcessGroup:
    """Rebuild the default group with other processes, and make it the default group.

    Every process of the new group calls it; it starts from its current world and
    follows its ``steps`` in order, each joining a communicator with others:

    - ``("link", id)``: the link :func:`spawn_peers` made (the starting world and the
      processes it started, on both sides; the whole starting world calls it);
    - ``("connect", port)``: the processes so far connect to the port (collective);
    - ``("accept", port)``: this process's world accepts on its port (collective), the
      other side of a ``connect``.

    Then the processes are ordered by ``key`` (the new ranks) and the result replaces the
    world (:func:`replace_world`).  Connect and accept wait as long as MPI does: a peer
    that never comes holds them.

    Raises:
        RuntimeError: a link this process does not hold, or MPI refused a step.
    """
    pg = default_group("regroup_world")
    ctx = pg.context
    comm: MPI.Intracomm = ctx.comm
    made: list[MPI.Intracomm] = []   # what this call made, freed at the end
    try:
        for kind, arg in steps:
            if kind == "link":
                if arg not in replacement.links:
                    raise located(RuntimeError, "reconfigure", f"no link {arg!r} here: the "
                                  "processes it leads to were not started by this world "
                                  "(spawn_peers) or were joined already", ctx)
                comm = replacement.links.pop(arg)
            elif kind in ("connect", "accept"):
                inter = comm.Connect(arg, root=0) if kind == "connect" else \
                    comm.Accept(arg, root=0)
                if kind == "accept":
                    close_port(arg)
                comm = inter.Merge(high=kind == "accept")
                inter.Free()
            else:
                raise ValueError(f"regroup_world: unknown step {kind!r}")
            made.append(comm)
            comm.Set_errhandler(MPI.ERRORS_RETURN)
        world = cast(MPI.Intracomm, comm.Split(0, key))
    except MPI.Exception as exc:
        raise located(RuntimeError, "reconfigure", f"MPI could not join the processes: "
                      f"{exc.Get_error_string()}", ctx) from exc
    finally:
        for c in made:
            c.Free()
    world.Set_errhandler(MPI.ERRORS_RETURN)
    return replace_world(world)
