"""A rank that exits while its peers may still wait for it: they hear it at once.

A rank whose program ends (``sys.exit``, the end of the script) while another still waits
in a collective with it would leave that one waiting for the group's timeout, and its
diagnosis could only say the rank does not answer.  At exit each rank tells the others
over the control channel (:func:`announce`, an ``atexit`` handler); a peer that hears it
(:func:`heard`) marks every group it shares with the exited rank departed, so a wait for
a collective of one of them raises GroupBrokenError naming the rank and what it did
last, within moments (a call that waits for nothing, as ``get_rank``, goes on).  On
every MPI alike: the exited process sits in ``MPI_Finalize`` (alive to MPI, also under
ULFM), so the survivors go on as after a planned removal: ``shrink_group`` of the exited
ranks (which only the stayers call), then ``heal`` if the job wants its size back.

A rank that ends normally tells the others the same; what they wait for then has
completed already (every rank reached it), and a wait that sees its group break tests
its op once more before it raises (``spmd.core.wait.wait_until``).
"""

from __future__ import annotations

import os
import threading
import time

from spmd.backends.mpi import faults, finalize
from spmd.core import flight_recorder
from spmd.runtime.group import world_state
from spmd.runtime.reliability import state

__all__ = ["announce", "exited", "exited_members", "heard", "reset"]

# Global rank -> what it said when it exited (the words of the errors naming it).
exited: dict[int, str] = {}
_lock = threading.Lock()


def _last_op() -> str:
    now = time.monotonic()
    entries = flight_recorder.recorder.entries()
    if not entries:
        return "before any op"
    b = flight_recorder.brief(entries[-1], now)
    state_ = "finished" if b["took"] is not None else "still in flight"
    return f"after {b['op']} #{b['seq']} on group {b['group']} ({state_})"


def announce() -> None:
    """At exit: tell every other rank of WORLD that this one is going (an ``atexit``
    handler; it runs before the control channel closes)."""
    ch, world = state.channel, world_state.world
    if ch is None or world is None or world.context.comm is None or world.context.size < 2:
        return
    me = world.context.ranks[world.context.rank]
    text = f"pid {os.getpid()}, {_last_op()}"
    if faults.ulfm():
        # Leave without MPI_Finalize, as a failed rank: Open MPI's finalize fence with
        # ranks still at work waits forever about one run in five (and a healed world
        # ends through destroy_process_group before this runs).
        finalize.note_failure()
    # Not to the ranks that exited already: nobody would receive it, and a send left
    # pending at MPI_Finalize can keep Open MPI's finalize waiting.
    with _lock:
        gone = set(exited)
    ch.notify([r for r in world.context.ranks if r != me and r not in gone],
              {"q": "exited", "from": me, "text": text})


def heard(rank: int, text: str) -> None:
    """A peer said it exits (runs on the control thread): break this rank's groups that
    hold it."""
    with _lock:
        exited[rank] = text
    if faults.ulfm():
        # Open MPI's finalize fence with a rank that left early waits forever about one
        # run in five (as after a failure): this process leaves without it.
        finalize.note_failure()
    for pg in list(world_state.groups):
        ctx = pg.context
        if ctx.comm is not None and rank in ctx.index:
            ctx.mark_departed(f"rank {rank} exited the program ({text})")


def exited_members(ctx) -> list[int]:
    """The group ranks of ``ctx``'s members that exited."""
    with _lock:
        return sorted(ctx.index[g] for g in exited if g in ctx.index)


def reset() -> None:
    """Forget the exits (the ranks are renumbered: shrinking or healing WORLD)."""
    with _lock:
        exited.clear()
