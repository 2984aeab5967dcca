"""After an op is given up, it owns none of the program's memory (spmd.backends.mpi.orphans).

A receive given up (its wait interrupted) is cancelled, and its message goes to the next
receive; a Work the program drops before its op completes is held with its arrays until
MPI is done; a collective given up is held and breaks its group, whose peers are told; a
set-up done on first use never blocks past the group's timeout, even for a rank that
arrives after its peer gave up and before the peer's word reached it.  The late-peer
jobs (tests/programs/late_peer.py) check the timeouts themselves, on both call paths.
"""

from __future__ import annotations

import gc
import signal
import time
from datetime import timedelta

import numpy as np
import pytest

pytestmark = pytest.mark.mpi


class _Interrupt(Exception):
    pass


def _interrupt_after(seconds: float):
    """Raise _Interrupt in the main thread after ``seconds`` (as Ctrl-C would)."""
    def handler(signum, frame):
        raise _Interrupt()
    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    return old


def _restore(old) -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def _ring(dist):
    """(the rank this one receives from, the one it sends to): a ring over WORLD."""
    n, me = dist.get_world_size(), dist.get_rank()
    if n < 2:
        pytest.skip("needs two ranks")
    return (me - 1) % n, (me + 1) % n


@pytest.mark.parametrize("shape", [(4,), (4, 2)], ids=["compiled", "python"])
def test_interrupted_receive_is_cancelled(dist, fresh, shape):
    """An interrupted blocking receive is cancelled: a message sent afterwards goes to the
    next receive, not into the first array; the group stays usable."""
    from spmd.backends.mpi import orphans

    src, dst = _ring(dist)
    g = fresh()
    held_before = orphans.held()   # what earlier tests' given-up ops still hold
    first = np.zeros(shape)[..., 0] if len(shape) > 1 else np.zeros(shape)
    old = _interrupt_after(0.2)
    try:
        with pytest.raises(_Interrupt):
            dist.recv(first, src=src, tag=77, group=g)   # nobody has sent it yet
    finally:
        _restore(old)
    assert orphans.held() == held_before and g.context.error is None
    dist.barrier()
    g.comm.Send(np.full(4, 5.0), dest=g.context.group_rank(dst), tag=77)
    second = np.zeros(4)
    dist.recv(second, src=src, tag=77, group=g)
    assert not first.any(), first
    np.testing.assert_array_equal(second, np.full(4, 5.0))


@pytest.mark.parametrize("shape", [(8,), (8, 2)], ids=["compiled", "python"])
def test_interrupted_collective_is_held_and_breaks_the_group(dist, fresh, shape):
    """Rank 0 is interrupted inside an all_reduce the others have not reached: its request
    and array are held, its group breaks, and the others' late all_reduce raises
    GroupBrokenError naming rank 0 instead of completing against it."""
    from spmd.backends.mpi import orphans

    n, me = dist.get_world_size(), dist.get_rank()
    if n < 2:
        pytest.skip("needs two ranks")
    g = fresh(timeout=timedelta(seconds=20))
    held_before = orphans.held()
    x = np.ones(shape)[..., 0] if len(shape) > 1 else np.ones(shape)
    if me == 0:
        old = _interrupt_after(0.3)
        try:
            with pytest.raises(_Interrupt):
                dist.all_reduce(x, group=g)
        finally:
            _restore(old)
        assert g.context.error is not None and "was given up on rank 0" in g.context.error
        assert orphans.held() == held_before + 1
        del x
        gc.collect()
        dist.barrier()
    else:
        dist.barrier()   # rank 0 gave up and told the others (they answered) before this
        with pytest.raises(dist.GroupBrokenError, match=r"told by rank 0"):
            dist.all_reduce(x, group=g)
        np.testing.assert_array_equal(x, np.ones(x.shape))
    with pytest.raises(dist.GroupBrokenError):
        dist.barrier(group=g)
    # Rank 0's held all_reduce ends here: the others reach it with MPI directly (a
    # nonblocking one: MPI matches nonblocking collectives only with nonblocking ones),
    # so rank 0 sees its hold end.
    if me != 0:
        g.context.comm.Iallreduce(np.ones(x.size), np.empty(x.size)).Wait()
    else:
        deadline = time.monotonic() + 10
        while orphans.reap() > held_before and time.monotonic() < deadline:
            time.sleep(0.001)
        assert orphans.held() == held_before
    dist.barrier()


def test_dropped_work_is_held_until_it_completes(dist):
    """An irecv whose Work the program drops still owns its array: the array is held, the
    message lands in it, and the hold ends once it has."""
    from spmd.backends.mpi import orphans

    src, dst = _ring(dist)
    pg = dist.GroupMember.WORLD
    held_before = orphans.held()
    box = np.zeros(3)
    dist.irecv(box, src=src, tag=78)   # the Work is dropped at once
    gc.collect()
    assert orphans.held() == held_before + 1
    dist.barrier()
    pg.comm.Send(np.array([1.0, 2.0, 3.0]), dest=dst, tag=78)
    deadline = time.monotonic() + 10
    while orphans.reap() > held_before and time.monotonic() < deadline:
        time.sleep(0.001)
    assert orphans.held() == held_before
    np.testing.assert_array_equal(box, [1.0, 2.0, 3.0])
    # Its flight-recorder entry ended with it: no receive stays "in flight" for the
    # watchdog and the diagnoses.
    from spmd.core.flight_recorder import recorder
    assert not [e for e in recorder.in_flight() if e.op in ("irecv", "recv")]


def test_polling_wait_keeps_the_op(dist):
    """wait(timeout) is a poll: past it the op is still the Work's (nothing cancelled,
    nothing held), and a later wait completes it."""
    from spmd.backends.mpi import orphans

    src, dst = _ring(dist)
    pg = dist.GroupMember.WORLD
    held_before = orphans.held()
    box = np.zeros(2)
    work = dist.irecv(box, src=src, tag=79)
    with pytest.raises(dist.DistTimeoutError):
        work.wait(timeout=0.1)
    assert not work.is_completed() and orphans.held() == held_before
    dist.barrier()
    pg.comm.Send(np.array([4.0, 5.0]), dest=dst, tag=79)
    work.wait()
    np.testing.assert_array_equal(box, [4.0, 5.0])


def test_set_up_never_blocks_past_the_timeout(dist):
    """A rank that reaches a first-use set-up after its peer gave it up, before the peer's
    notice arrived (here: no notice is sent), gets DistTimeoutError from the set-up's own
    deadline instead of blocking in its collective forever."""
    from spmd.backends.setup import set_up
    from spmd.core import context

    n, me = dist.get_world_size(), dist.get_rank()
    if n < 2:
        pytest.skip("needs two ranks")
    g = dist.new_group(list(range(n)), timeout=timedelta(seconds=1))
    ctx = g.context

    def blocking():   # a blocking collective every member must enter
        return ctx.comm.bcast("value" if ctx.rank == 0 else None, root=0)

    if me == 0:
        notice = context._tell_peers
        context.set_broken_notice(None)   # the peer does not hear of it in time
        try:
            with pytest.raises(dist.DistTimeoutError, match="setting up a test"):
                set_up(ctx, "test_op", "a test", lambda: None)
        finally:
            context.set_broken_notice(notice)
        dist.barrier()
        dist.barrier()
        blocking()   # lets the late rank's set-up thread out of its bcast
    else:
        dist.barrier()   # rank 0 has given up
        t0 = time.monotonic()
        # Its own deadline; with three ranks or more, the other late rank's notice may
        # come first (that rank timed out the same way).
        with pytest.raises((dist.DistTimeoutError, dist.GroupBrokenError),
                           match="setting up a test|told by rank"):
            set_up(ctx, "test_op", "a test", blocking)
        assert time.monotonic() - t0 < 1 + 5
        dist.barrier()
    dist.barrier()
