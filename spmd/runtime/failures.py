"""What the runtime does when ranks die (an MPI with ULFM; ``spmd.backends.mpi.faults``
finds the failure and has the survivors agree on it).

- The survivors of a group agree on its dead members: :func:`on_group_failed` then ends
  the group's operations in the flight recorder as failed because a rank died (not as
  timeouts), revokes every other group that holds a dead rank (so no survivor stays
  blocked in one of its ops) and reports it once.
- The watchdog asks MPI which ranks it knows to be dead at every tick
  (:func:`watch`), so a failure is found within a tick even where no rank waits on
  MPI: the groups holding the dead ranks are revoked, and every wait of spmd's own
  (the shared-memory engine's, debug mode's...) raises the group's failure instead of
  waiting for its timeout (:func:`failure_in`).
"""

from __future__ import annotations

import threading

from spmd.backends import checked
from spmd.backends.mpi import faults
from spmd.core import flight_recorder
from spmd.core import wait as _wait
from spmd.core.context import GroupContext
from spmd.runtime.group import world_state
from spmd.runtime.reliability import report

__all__ = ["install", "reset", "on_group_failed", "watch", "failure_in", "known_dead"]

_lock = threading.Lock()
known_dead: set[int] = set()     # global ranks found dead so far (locally or agreed)


def _contexts() -> list[GroupContext]:
    return [pg.context for pg in list(world_state.groups)]


def _revoke(dead: set[int], besides: GroupContext | None = None) -> list[str]:
    """Revoke every group holding a rank in ``dead`` (and debug mode's communicators of
    those groups); their names."""
    groups = [ctx for ctx in _contexts() if ctx is not besides and ctx.failed is None]
    names = faults.revoke_groups_of(dead, groups)
    for ctx in groups:
        if dead.intersection(ctx.ranks):
            for comm in checked.check_comms(ctx):
                faults.revoke(comm)
    return names


def on_group_failed(ctx: GroupContext, failed: tuple[int, ...]) -> None:
    """The survivors of ``ctx`` agreed that ``failed`` died."""
    flight_recorder.recorder.mark_rank_died(ctx)
    with _lock:
        new = set(failed) - known_dead
        known_dead.update(failed)
    revoked = _revoke(set(failed), besides=ctx)
    _wait.set_failure_check(failure_in)
    if new:
        report(f"spmd: rank(s) {sorted(failed)} of group {ctx.name} died; the survivors agreed "
               f"on it, and ops on the groups that hold them raise ProcessFailedError"
               + (f" (revoked: {', '.join(revoked)})" if revoked else ""))


def watch() -> None:
    """One watchdog tick: the ranks MPI now knows to be dead, that no op has reported."""
    world = world_state.world
    if world is None or not faults.ulfm():
        return
    dead = set(faults.known_failed(world.context))
    with _lock:
        new = dead - known_dead
        known_dead.update(new)
    if not new:
        return
    revoked = _revoke(new)
    _wait.set_failure_check(failure_in)
    report(f"spmd watchdog: rank(s) {sorted(new)} died; revoked the groups that hold them "
           f"({', '.join(revoked) or 'none'}): their ops raise ProcessFailedError")


def failure_in(op: str, ctx: GroupContext) -> BaseException | None:
    """For a wait of spmd's own on ``ctx``: the group's failure if a member is known dead
    (the survivors agree on it first), else None."""
    if ctx.failed is None:
        if ctx.comm is None or not known_dead.intersection(ctx.ranks):
            return None
        faults.agree(ctx)
    return ctx.failure_error(op) if ctx.failed else None


def install() -> None:
    """Called at init: the agreement's follow-up is this module's; no rank is known dead."""
    faults.on_failure = on_group_failed
    faults.ulfm()   # probed now, at a quiet time, not in the middle of a failure
    reset()


def reset() -> None:
    """Forget the dead ranks (at init, and when shrinking WORLD renumbers the ranks)."""
    with _lock:
        known_dead.clear()
    _wait.set_failure_check(None)
