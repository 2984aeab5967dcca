"""What the runtime does when ranks die (an MPI with ULFM; ``spmd.backends.mpi.faults``
has the MPI side).

One agreement per failure, on WORLD.  The first survivor that meets a failure (an op of
any group, a wait, or the watchdog, which asks MPI for dead ranks at every tick while
nobody waits) revokes **every** communicator it belongs to, so each survivor's pending
or next spmd op fails, wherever it is blocked, and brings it here: :func:`agree` runs
``MPI_Comm_shrink`` on WORLD, once, on every survivor.  Agreeing group by group, at
whatever op each survivor met the failure, could leave two survivors each waiting in
the other's group's shrink; one agreement on the group every survivor holds cannot.

From the agreed set every group is marked on this rank without another collective: a
group holding a dead rank raises :class:`spmd.ProcessFailedError` naming them (the same
set on every survivor), any other group (revoked on the way) raises GroupBrokenError;
their flight-recorder entries end as failed because a rank died.  ``shrink_group``
builds new groups from the survivors' communicator the agreement made
(:func:`survivors`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from spmd.backends import checked
from spmd.backends.mpi import faults
from spmd.core import flight_recorder
from spmd.core import wait as _wait
from spmd.core.context import GroupContext
from spmd.core.errors import GroupBrokenError
from spmd.runtime import hangs
from spmd.runtime.group import world_state
from spmd.runtime.reliability import report

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["install", "reset", "agree", "survivors", "watch", "failure_in", "known_dead"]

_lock = threading.RLock()        # one agreement; the watchdog only revokes
known_dead: set[int] = set()     # global ranks found dead so far (locally or agreed)
_agreed: tuple[int, ...] | None = None    # the agreement's dead ranks, once made
_survivors: MPI.Intracomm | None = None   # ... and WORLD's survivors


def _contexts() -> list[GroupContext]:
    return [pg.context for pg in list(world_state.groups)]


def _revoke_all() -> None:
    """Revoke every communicator of this rank's groups (and debug mode's of them): a
    survivor blocked in any of them wakes up and comes to the agreement."""
    for ctx in _contexts():
        if ctx.comm is not None:
            faults.revoke(ctx.comm)
            for comm in checked.check_comms(ctx):
                faults.revoke(comm)


def agree() -> tuple[int, ...]:
    """The dead ranks (global), as every survivor agreed on them on WORLD (made at the
    first call after a failure, on every survivor; later calls return it)."""
    global _agreed, _survivors
    with _lock:
        if _agreed is not None:
            return _agreed
        world = world_state.world
        assert world is not None   # a failure was met on one of its groups
        _revoke_all()
        dead, live = faults.shrink_agreement(world.context)
        _agreed, _survivors = dead, live
        known_dead.update(dead)
        wrongly = hangs.end_excluded(dead)
        for ctx in _contexts():
            mine = tuple(g for g in dead if g in ctx.index)
            if mine:
                flight_recorder.recorder.mark_rank_died(ctx)
                ctx.mark_failed(mine)
            else:
                ctx.mark_broken(f"ranks {list(dead)} died (every group was revoked so that "
                                "no survivor stays blocked)", tell_peers=False)
        _wait.set_failure_check(failure_in)
    report(f"spmd: rank(s) {list(dead)} died; the survivors agreed on it: ops on the groups "
           "that hold them raise ProcessFailedError, every other group was revoked "
           "(GroupBrokenError); spmd.shrink_group() makes the new groups")
    if wrongly:
        report(f"spmd: the process(es) of rank(s) {wrongly} still ran though the agreement "
               "excluded them: ended them, so that no process goes on with a world that "
               "left it out")
    return dead


def survivors() -> MPI.Intracomm | None:
    """WORLD's survivors' communicator the agreement made (None before one)."""
    return _survivors


def _error(op: str, ctx: GroupContext) -> BaseException:
    if ctx.failed is not None:
        return ctx.failure_error(op)
    return GroupBrokenError(f"{op}: group {ctx.name} was revoked after rank(s) "
                            f"{list(_agreed or ())} died elsewhere; spmd.shrink_group() "
                            f"makes the new groups [rank {ctx.rank}, group {ctx.name}]")


def on_failure(op: str, ctx: GroupContext) -> BaseException:
    """MPI reported a dead rank (or a revoked communicator) in ``op`` on ``ctx``: agree,
    then the group's error."""
    agree()
    return _error(op, ctx)


def watch() -> None:
    """One watchdog tick: ranks MPI now knows to be dead that no op has met yet.  The
    groups are revoked (each survivor's next op brings it to the agreement); agreeing
    is the main thread's."""
    world = world_state.world
    if world is None or not faults.ulfm() or not faults.threads_may_call():
        return
    dead = set(faults.known_failed(world.context))
    with _lock:
        new = dead - known_dead
        known_dead.update(new)
    if not new:
        return
    _revoke_all()
    _wait.set_failure_check(failure_in)
    report(f"spmd watchdog: rank(s) {sorted(new)} died; revoked this rank's groups: their ops "
           "raise ProcessFailedError (or GroupBrokenError) after the survivors agree")


def failure_in(op: str, ctx: GroupContext) -> BaseException | None:
    """For a wait of spmd's own on ``ctx`` once a rank is known dead: the agreement,
    then the group's error."""
    if ctx.comm is None or not known_dead:
        return None
    agree()
    return _error(op, ctx)


def install() -> None:
    """Called at init: the agreement's follow-up is this module's; no rank is known dead."""
    faults.on_failure = on_failure
    faults.ulfm()   # probed now, at a quiet time, not in the middle of a failure
    reset()


def reset() -> None:
    """Forget the dead ranks and the agreement (at init, and when shrinking WORLD
    renumbers the ranks)."""
    global _agreed, _survivors
    with _lock:
        known_dead.clear()
        _agreed = _survivors = None
    _wait.set_failure_check(None)
