"""What the NCCL engine does per call, on the device double: a blocking call goes on the
caller's current stream (as c10d's NCCL backend does for async_op=False) and one that may
be waited for later on the communicator's stream; end events are reused once their op
has passed; all_reduce's plan of a dtype and op is resolved once; and destroying a group
waits for the blocking calls still running on their callers' streams."""

import numpy as np
import pytest
from _gpu_helpers import on_device_double

from spmd.backends.nccl.communicator import SPARE_EVENTS, Ran
from spmd.testing import device_double as dd

pytestmark = pytest.mark.mpi
if not on_device_double():
    pytest.skip("runs on the device double: SPMD_TEST_DEVICE=double (tests/run.sh does)",
                allow_module_level=True)

SPEC = "cpu:mpi,cuda:nccl"


@pytest.fixture
def cp(dist):
    yield dd.cupy
    dd.release()


def _last_work(g):
    return g.engine_for("cuda").communicator.inflight[-1]


def test_blocking_calls_go_on_the_callers_stream(dist, cp, fresh):
    n = dist.get_world_size()
    g = fresh(backend=SPEC)
    x = cp.ones(4, cp.float32)
    dist.all_reduce(x, group=g)
    dd.runtime.deviceSynchronize()   # (the side stream below is not ordered after it)
    side = cp.cuda.Stream(non_blocking=True)
    dd.hold()
    try:
        with side:
            dist.all_reduce(x, group=g)
            blocking = _last_work(g)
            y = x * 2   # queued on the side stream, after the all_reduce
            work = dist.all_reduce(x, group=g, async_op=True)   # after the side stream
        assert blocking.on_caller and not work.on_caller
        assert not blocking.end.done   # the device is held: queued, not run
    finally:
        dd.release()
    work.wait()
    np.testing.assert_array_equal(y.get(), np.full(4, 2.0 * n * n, np.float32))
    np.testing.assert_array_equal(x.get(), np.full(4, float(n ** 3), np.float32))
    # every op still runs, in order, on every rank
    b = cp.full(3, float(dist.get_rank()), cp.float32)
    dist.broadcast(b, src=n - 1, group=g)
    np.testing.assert_array_equal(b.get(), np.full(3, float(n - 1), np.float32))


def test_a_blocking_all_reduce_is_recorded_without_a_work(dist, cp, fresh):
    """Where only the flight recorder observes Works, the common blocking all_reduce
    leaves no Work: its recorder entry ends when the GPU passes its end event, its
    arrays are released then; another observer (the comms log here) gets a Work."""
    from spmd.core import flight_recorder as fr
    from spmd.core import work as work_mod

    g = fresh(backend=SPEC)
    x = cp.ones(4, cp.float32)
    dist.all_reduce(x, group=g)   # resolves the plan
    dd.hold()
    try:
        dist.all_reduce(x, group=g)
        ran = _last_work(g)
        assert isinstance(ran, Ran) and ran.keep is x
        entry = fr.recorder.entries()[-1]
        assert entry.op == "all_reduce" and entry.engine == "NCCL" and entry.t1 is None
        assert entry.group is g.context
    finally:
        dd.release()
    dd.runtime.deviceSynchronize()
    assert [e for e in fr.recorder.in_flight() if e.group is g.context] == []
    dist.all_reduce(x, group=g)   # reaps the one before
    assert ran.keep is None
    seen = []

    class Observer:
        def started(self, work):
            seen.append(work)

        def completed(self, work):
            pass

    obs = Observer()
    work_mod.add_observer(obs)
    try:
        dist.all_reduce(x, group=g)
    finally:
        work_mod.remove_observer(obs)
    assert [w.op for w in seen] == ["all_reduce"] and not isinstance(_last_work(g), Ran)
    np.testing.assert_array_equal(x.get(), np.full(4, float(dist.get_world_size() ** 4)))


def test_a_read_right_after_a_blocking_all_reduce_sees_the_result(dist, cp, fresh):
    """Nothing waits between the call and the read: a read (which synchronises the
    caller's current stream) right after a blocking all_reduce sees the reduced data,
    written just before the call (queued, not run), on the default stream and on another
    current stream."""
    me, n = dist.get_rank(), dist.get_world_size()
    g = fresh(backend=SPEC)
    x = cp.zeros(5, cp.float32)
    dist.all_reduce(x, group=g)   # resolves the plan: the calls below leave no Work
    side = cp.cuda.Stream(non_blocking=True)
    for i in range(6):
        stream = side if i % 2 else cp.cuda.Stream.null
        with stream:
            x[...] = me + i
            dist.all_reduce(x, group=g)
            got = x.get()
            assert isinstance(_last_work(g), Ran)
        np.testing.assert_array_equal(got, np.full(5, float(sum(r + i for r in range(n)))))


def test_end_events_are_reused(dist, cp, fresh):
    g = fresh(backend=SPEC)
    x = cp.ones(2, cp.float32)
    ends = set()
    for _ in range(20):
        x[...] = 1
        dist.all_reduce(x, group=g)
        ends.add(id(_last_work(g).end))
        dd.runtime.deviceSynchronize()
    assert len(ends) <= 2, len(ends)
    nc = g.engine_for("cuda").communicator
    assert len(nc.spare) <= SPARE_EVENTS
    np.testing.assert_array_equal(x.get(), np.full(2, float(dist.get_world_size())))


@pytest.mark.parametrize("dtype, op", [("float32", "SUM"), ("complex64", "SUM"),
                                       ("bool", "MAX"), ("float32", "AVG"),
                                       ("int32", "MIN")])
def test_a_plan_resolved_once_reduces_alike(dist, cp, fresh, dtype, op):
    """The second call of a (dtype, op) takes the plan the first one resolved: the same
    results, for types NCCL counts in pairs (complex) and ops it has natively (AVG)."""
    me, n = dist.get_rank(), dist.get_world_size()
    g = fresh(backend=SPEC)
    red = getattr(dist.ReduceOp, op)
    engine = g.engine_for("cuda")
    for call in range(3):
        host = (np.arange(6) + me + call).astype(dtype)
        if dtype == "bool":
            host = (np.arange(6) + me + call) % 3 == 0
        x = cp.asarray(host)
        dist.all_reduce(x, op=red, group=g)
        every = [((np.arange(6) + r + call) % 3 == 0) if dtype == "bool"
                 else (np.arange(6) + r + call).astype(dtype) for r in range(n)]
        want = {"SUM": np.sum, "MAX": np.max, "MIN": np.min, "AVG": np.mean}[op](every, axis=0)
        np.testing.assert_allclose(x.get(), np.asarray(want).astype(x.dtype), rtol=1e-6)
    if op != "AVG":   # (AVG: NCCL's own where the library has it, else a division after)
        assert (np.dtype(dtype), id(red)) in engine._direct


def test_a_strided_array_and_premul_take_the_full_path(dist, cp, fresh):
    me, n = dist.get_rank(), dist.get_world_size()
    g = fresh(backend=SPEC)
    base = cp.asarray(np.tile(np.arange(4, dtype=np.float32) + me, (3, 1)))
    for _ in range(2):
        col = base[:, 1]           # strided: copied to a contiguous buffer and back
        dist.all_reduce(col, group=g)
    got = base.get()
    np.testing.assert_array_equal(got[:, 1], np.full(3, n * sum(1 + r for r in range(n))))
    np.testing.assert_array_equal(got[:, 0], np.full(3, float(me)))   # the rest untouched
    premul = dist.make_premul_sum(2.0)
    y = cp.ones(3, cp.float32)
    dist.all_reduce(y, op=premul, group=g)
    dist.all_reduce(y, op=premul, group=g)
    np.testing.assert_array_equal(y.get(), np.full(3, 4.0 * n * n, np.float32))


def test_destroy_waits_for_blocking_calls_on_callers_streams(dist, cp):
    """Arrays nobody else holds, sent and reduced by blocking calls still queued on the
    caller's stream when the group is destroyed: the destroy waits for them (their
    memory is read and written until they complete)."""
    me, n = dist.get_rank(), dist.get_world_size()
    for _ in range(3):
        g = dist.new_group(list(range(n)), backend=SPEC)
        dist.all_reduce(cp.ones(1, cp.float32), group=g)
        out = cp.zeros(1 << 16, cp.float32)
        dd.hold()
        try:
            for _ in range(4):
                dist.all_reduce(cp.full(1 << 16, float(me), cp.float32), group=g)
            dist.all_reduce(out, group=g)
            if n > 1:
                if me == 0:
                    dist.send(cp.full(1 << 16, 5.0, cp.float32), dst=1, group=g)
                elif me == 1:
                    got = cp.zeros(1 << 16, cp.float32)
                    dist.recv(got, src=0, group=g)
        finally:
            dd.release()
        dist.destroy_process_group(g)
        np.testing.assert_array_equal(out.get(), np.zeros(1 << 16, np.float32))
        if n > 1 and me == 1:
            np.testing.assert_array_equal(got.get(), np.full(1 << 16, 5.0, np.float32))
