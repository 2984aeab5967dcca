"""Work and Future: wait/timeout, completion queries, futures and callbacks."""

import time

import numpy as np
import pytest
from mpi4py import MPI

pytestmark = pytest.mark.mpi


def test_work_api_on_all_reduce(dist):
    n = dist.get_world_size()
    x = np.ones(5, np.float32)
    work = dist.all_reduce(x, async_op=True)
    fut = work.get_future()
    assert work.wait() is True
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert fut.done()
    (out,) = fut.value()
    assert out is x
    np.testing.assert_array_equal(x, np.full(5, n, np.float32))
    assert work.result()[0] is x
    assert fut.wait()[0] is x
    work.synchronize()
    with pytest.raises(RuntimeError, match="only defined for receives"):
        work.source_rank()


def test_future_then_and_callbacks(dist):
    n = dist.get_world_size()
    x = np.arange(3.0)
    work = dist.all_reduce(x, async_op=True)
    seen = []
    fut = work.get_future()
    fut.add_done_callback(lambda f: seen.append("cb"))
    chained = fut.then(lambda f: f.value()[0].sum()).then(lambda f: f.value() * 2)
    assert chained.wait() == pytest.approx(2 * n * 3.0)
    assert seen == ["cb"]
    failing = dist.all_reduce(np.ones(1), async_op=True).get_future().then(lambda f: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.wait()


def test_collect_all_and_wait_all(dist):
    n = dist.get_world_size()
    arrays = [np.full(2, float(k)) for k in range(4)]
    futs = [dist.all_reduce(a, async_op=True).get_future() for a in arrays]
    values = dist.futures.wait_all(futs)
    for k, v in enumerate(values):
        np.testing.assert_array_equal(v[0], np.full(2, k * n))
    done = dist.futures.collect_all([dist.barrier(async_op=True).get_future()]).wait()
    assert len(done) == 1 and done[0].done()
    manual = dist.Future()
    manual.set_result(5)
    assert manual.done() and manual.wait() == 5
    with pytest.raises(RuntimeError, match="already completed"):
        manual.set_result(6)
    with pytest.raises(RuntimeError, match="not completed"):
        dist.Future().value()


def test_wait_timeout_raises_dist_timeout(dist):
    """A receive nobody matches: wait(timeout) raises DistTimeoutError naming the op."""
    pg = dist.GroupMember.WORLD
    buf = np.zeros(1)
    work = dist.irecv(buf, tag=4242)
    t0 = time.monotonic()
    with pytest.raises(dist.DistTimeoutError, match=r"recv: .*did not complete within 0\.\d s"):
        work.wait(timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 5
    assert not work.is_completed()
    # complete it with a message to ourselves so the request does not leak
    pg.comm.Send(np.array([3.0]), dest=pg.rank(), tag=4242)
    work.wait()
    assert buf[0] == 3.0 and work.source_rank() == dist.get_rank()


def test_async_keeps_arrays_alive_and_results_land_in_views(dist):
    n = dist.get_world_size()
    works, views = [], []
    for k in range(8):
        base = np.zeros((4, 4))
        view = base[:, 1]
        view[...] = k
        works.append(dist.all_reduce(view, async_op=True))
        views.append(view)
        del base  # only the view (and the Work) keep the memory alive
    for w in works:
        w.wait()
    for k, v in enumerate(views):
        np.testing.assert_array_equal(v, np.full(4, k * n))


def test_wait_timeout_argument_checks(dist):
    work = dist.barrier(async_op=True)
    with pytest.raises(ValueError, match="barrier: Work.wait: timeout must be a non-negative "
                       "timedelta or number of seconds, got -1"):
        work.wait(timeout=-1)
    with pytest.raises(TypeError, match="timeout must be a datetime.timedelta or a number of "
                       "seconds, got str"):
        work.wait(timeout="1")
    work.wait()


def test_mpi_status_is_not_shared(dist):
    """Concurrent any-source receives each know their own sender."""
    me, n = dist.get_rank(), dist.get_world_size()
    if n < 3:
        pytest.skip("needs three ranks")
    if me == 0:
        bufs = [np.zeros(1) for _ in range(n - 1)]
        works = [dist.irecv(b, tag=9) for b in bufs]
        senders = sorted(w.source_rank() for w in works)
        assert senders == list(range(1, n))
        assert sorted(b[0] for b in bufs) == [float(r) for r in range(1, n)]
    else:
        dist.send(np.array([float(me)]), dst=0, tag=9)
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE
