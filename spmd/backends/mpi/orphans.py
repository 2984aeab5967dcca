"""MPI requests of ops the program gave up on, and the memory they still use.

A nonblocking MPI op owns its buffers until its request completes: MPI writes a
receive's message, or a collective's result, into them whenever the peers get there.
When a wait for such an op ends without it (the group's timeout, an interrupt, a dead
or departed peer, the group broken by a peer), the program goes on and may free or
reuse those arrays, so the op must not be left to write into them:

- a receive is cancelled (``MPI_Cancel``, then waited, which for a cancelled receive is
  local); if its message had already matched, the cancel fails and the message is
  delivered: the op completed after all and nothing is lost;
- anything else (a send, a collective: MPI cannot cancel them) is *held*: its requests
  and its buffers stay referenced here until the requests complete or the process ends,
  so the memory is never handed to another array while MPI may still write into it.

Held requests are tested (never waited for) whenever a new one is held and when the
runtime's periodic check asks (:func:`reap`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

__all__ = ["give_up", "hold", "held", "reap"]

_lock = threading.Lock()
# (requests, buffers, what to run once they completed), per held op
_held: list[tuple[list[MPI.Request], Any, Callable[[], None] | None]] = []


def reap() -> int:
    """Drop what MPI has finished with; return how many ops are still held."""
    global _held
    finished = []
    with _lock:
        keep = []
        for reqs, buffers, then in _held:
            try:
                done = MPI.Request.Testall(reqs)
            except MPI.Exception:  # some ended in error (a dead peer, a revoked communicator)
                reqs = [r for r in reqs if r]   # the ones MPI has not released yet
                done = not reqs
            if not done:
                keep.append((reqs, buffers, then))
            elif then is not None:
                finished.append(then)
        _held = keep
        count = len(_held)
    for then in finished:
        then()
    return count


def held() -> int:
    """How many given-up ops still hold their buffers (for diagnoses and tests)."""
    with _lock:
        return len(_held)


def hold(reqs: list[MPI.Request], buffers: Any, then: Callable[[], None] | None = None) -> None:
    """Keep ``reqs`` and ``buffers`` referenced until the requests complete, then run
    ``then`` (a dropped Work's flight-recorder entry ends there)."""
    with _lock:
        _held.append((list(reqs), buffers, then))
    reap()


def _cancel_receive(req: MPI.Request) -> bool:
    """Cancel a pending receive; True if its message had matched and was delivered."""
    status = MPI.Status()
    try:
        req.Cancel()
        req.Wait(status)   # local once cancelled: MPI_Cancel's contract
    except MPI.Exception:  # the peer died meanwhile: nothing arrives any more
        return False
    return not status.Is_cancelled()


def give_up(reqs: list[MPI.Request], buffers: Any, *, receive: bool) -> bool:
    """Stop waiting for an op's requests, leaving MPI nothing to write into that the
    program may reuse.

    Args:
        reqs: the op's requests.
        buffers: every array and staging buffer the op reads or writes.
        receive: the op is one receive (it can be cancelled).

    Returns:
        True if the op completed after all (finished meanwhile, or a receive whose
        message had already matched): its results are in place. False if it did not: a
        receive was cancelled, or the requests are held with their buffers.
    """
    try:
        if MPI.Request.Testall(reqs):
            return True
    except MPI.Exception:  # ended in error (a dead peer): hold what MPI has not released
        hold([r for r in reqs if r], buffers)
        return False
    if receive and len(reqs) == 1:
        return _cancel_receive(reqs[0])
    hold(reqs, buffers)
    return False
