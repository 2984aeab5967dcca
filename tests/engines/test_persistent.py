"""Persistent collectives: results over several starts, native and fallback paths, and
misuse (start while in flight, start after free)."""

import os

import numpy as np
import pytest

from spmd.api import persistent

pytestmark = pytest.mark.mpi


@pytest.fixture(params=["native", "fallback", "auto"])
def mode(request, monkeypatch, dist):
    """native: the library's persistent collectives (where it runs them right);
    fallback: nonblocking collectives (SPMD_PERSISTENT=0); auto: whatever spmd chose on
    this library, results checked all the same."""
    if request.param == "fallback":
        monkeypatch.setenv("SPMD_PERSISTENT", "0")
    elif request.param == "native":
        if not persistent.available():
            pytest.skip("this MPI library has no persistent collectives")
        if not persistent.native_on(dist.GroupMember.WORLD):
            pytest.skip("this MPI library restarts a persistent all-gather wrongly on this "
                        "group (Intel MPI 2021.18 at 2 and 4 ranks): plans fall back")
    return request.param


def _check_native(plan, mode):
    if mode != "auto":
        assert plan.native == (mode == "native"), plan


def test_all_reduce_over_starts(dist, mode):
    n, rank = dist.get_world_size(), dist.get_rank()
    x = np.zeros(5, np.float32)
    with persistent.all_reduce(x) as plan:
        _check_native(plan, mode)
        for k in range(4):
            x[:] = rank + k
            work = plan.start()
            assert isinstance(work, dist.Work)
            work.wait()
            np.testing.assert_array_equal(x, np.full(5, n * (n - 1) / 2 + n * k, np.float32))
    assert "freed" in repr(plan)


@pytest.mark.parametrize("opname", ["AVG", "MAX"])
def test_all_reduce_ops(dist, mode, opname):
    n, rank = dist.get_world_size(), dist.get_rank()
    x = np.zeros(3, np.int64)
    with persistent.all_reduce(x, op=getattr(dist.ReduceOp, opname)) as plan:
        _check_native(plan, mode)
        for k in range(3):
            x[:] = 10 * rank + k
            plan.start().wait()
            total = 10 * n * (n - 1) // 2 + n * k
            want = total // n if opname == "AVG" else 10 * (n - 1) + k
            np.testing.assert_array_equal(x, np.full(3, want))


def test_movement_and_rooted_plans(dist, mode):
    n, rank = dist.get_world_size(), dist.get_rank()
    root = n - 1
    b = np.zeros(4, np.int32)
    r = np.zeros(2, np.float64)
    gin, gout = np.zeros(2, np.float32), np.zeros(2 * n, np.float32)
    sin, sout = np.zeros(3 * n, np.float64), np.zeros(3, np.float64)
    ain, aout = np.zeros(2 * n, np.int64), np.zeros(2 * n, np.int64)
    plans = [persistent.broadcast(b, src=root), persistent.reduce(r, dst=root),
             persistent.all_gather_into_tensor(gout, gin),
             persistent.reduce_scatter_tensor(sout, sin),
             persistent.all_to_all_single(aout, ain), persistent.barrier()]
    try:
        for p in plans:
            _check_native(p, mode)
        for k in range(3):
            b[:] = (k + 7) if rank == root else -1
            r[:] = rank + k
            gin[:] = rank * 10 + k
            sin[:] = np.arange(3 * n) + k
            ain[:] = 100 * rank + np.arange(2 * n)
            for w in [p.start() for p in plans]:
                w.wait()
            np.testing.assert_array_equal(b, np.full(4, k + 7))
            if rank == root:
                np.testing.assert_array_equal(r, np.full(2, n * (n - 1) / 2 + n * k))
            np.testing.assert_array_equal(gout, np.repeat([10 * q + k for q in range(n)], 2))
            np.testing.assert_array_equal(sout, n * (np.arange(3 * rank, 3 * rank + 3) + k))
            want = np.concatenate([100 * q + np.arange(2 * rank, 2 * rank + 2)
                                   for q in range(n)])
            np.testing.assert_array_equal(aout, want)
    finally:
        for p in plans:
            p.free()


def _fused_arrays(rank: int, step: int) -> list:
    """Many small arrays of three dtypes (one float32 bucket, an int64 and a float64
    array alone in theirs), shapes 1-D to 3-D, filled from rank and step."""
    arrays = [np.full((3, i + 1), rank + i + step, np.float32) for i in range(12)]
    arrays += [np.full((2, 2, 2), rank * step, np.int64), np.arange(7.0) * (rank + step)]
    return arrays


@pytest.mark.parametrize("opname", ["SUM", "AVG", "MAX"])
@pytest.mark.parametrize("bucket_bytes", [None, 64])   # 64 B: several buckets per dtype
def test_all_reduce_coalesced_over_starts(dist, mode, opname, bucket_bytes, monkeypatch):
    from spmd.backends.mpi import packing

    if bucket_bytes is not None:
        monkeypatch.setattr(packing, "_bucket_bytes", bucket_bytes)
    n, rank = dist.get_world_size(), dist.get_rank()
    op = getattr(dist.ReduceOp, opname)
    arrays = _fused_arrays(rank, 0)
    with persistent.all_reduce_coalesced(arrays, op) as plan:
        _check_native(plan, mode)
        for step in range(3):
            for a, fresh in zip(arrays, _fused_arrays(rank, step)):  # refill in place
                a[...] = fresh
            plan.start().wait()
            per_rank = [_fused_arrays(r, step) for r in range(n)]
            for i, a in enumerate(arrays):
                stack = np.stack([p[i] for p in per_rank])
                if opname == "SUM":
                    want = stack.sum(0)
                elif opname == "MAX":
                    want = stack.max(0)
                else:   # integer AVG truncates, as torch's
                    want = stack.sum(0) // n if a.dtype.kind == "i" else stack.mean(0)
                np.testing.assert_allclose(a, want.astype(a.dtype), rtol=1e-6, err_msg=str(i))


def test_all_reduce_coalesced_fused_by_the_shared_memory_engine(dist):
    """One dtype, one bucket, at the shared-memory engine's sizes: each start is the
    engine's fused all-reduce (faster than MPI's persistent one), not a native start;
    numpy's result at every start."""
    n, rank = dist.get_world_size(), dist.get_rank()
    engine = dist.GroupMember.WORLD.engine_for("cpu")
    shm = getattr(engine, "shm", None)   # debug mode's engine stands in front of it
    if shm is None or shm.all_reduce_from > (1 << 22):
        pytest.skip("no shared-memory engine for all_reduce here")
    count = max(shm.all_reduce_from, 4096) // 4 // 8 + 1
    arrays = [np.zeros(count, np.float32) for _ in range(8)]
    assert engine.fused_start(arrays, dist.ReduceOp.SUM) is not None
    with persistent.all_reduce_coalesced(arrays) as plan:
        assert not plan.native
        for step in range(3):
            for k, a in enumerate(arrays):
                a[...] = rank + k + step
            plan.start().wait()
            for k, a in enumerate(arrays):
                np.testing.assert_array_equal(a, np.float32(sum(r + k + step for r in range(n))))


def test_all_reduce_coalesced_non_contiguous_and_bad_input(dist):
    n = dist.get_world_size()
    base = np.ones((4, 4))
    arrays = [base[:, ::2], np.ones(3)]
    with persistent.all_reduce_coalesced(arrays) as plan:
        assert not plan.native   # the ordinary fused collective at each start
        plan.start().wait()
    np.testing.assert_array_equal(base[:, ::2], np.full((4, 2), float(n)))
    np.testing.assert_array_equal(base[:, 1::2], np.ones((4, 2)))
    np.testing.assert_array_equal(arrays[1], np.full(3, float(n)))
    with pytest.raises(ValueError, match="tensors is empty"):
        persistent.all_reduce_coalesced([])
    with pytest.raises(TypeError, match="BAND"):
        persistent.all_reduce_coalesced([np.zeros(2)], op=dist.ReduceOp.BAND)
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(2)
        ro.flags.writeable = False
        persistent.all_reduce_coalesced([np.zeros(2), ro])


def test_non_contiguous_uses_the_ordinary_collective(dist):
    n = dist.get_world_size()
    base = np.ones((4, 4))
    view = base[:, ::2]
    with persistent.all_reduce(view) as plan:
        assert not plan.native
        for _ in range(2):
            plan.start().wait()
    np.testing.assert_array_equal(view, np.full((4, 2), float(n * n)))
    np.testing.assert_array_equal(base[:, 1::2], np.ones((4, 2)))


def test_misuse(dist):
    from mpi4py import MPI

    x = np.zeros(2)
    plan = persistent.all_reduce(x)
    rank, n = dist.get_rank(), dist.get_world_size()
    # Debug mode (DETAIL) checks each start() across the group: no rank starts alone.
    alone = os.environ.get("SPMD_DEBUG", "").upper() != "DETAIL"
    if rank == 0 and n > 1 and alone:
        # the others start only after the barrier: this start cannot complete before it
        work = plan.start()
        with pytest.raises(RuntimeError, match="in flight"):
            plan.start()
        MPI.COMM_WORLD.Barrier()
    else:
        if n > 1 and alone:
            MPI.COMM_WORLD.Barrier()
        work = plan.start()
    work.wait()
    plan.free()
    plan.free()  # twice is fine
    with pytest.raises(RuntimeError, match="freed plan"):
        plan.start()
    with pytest.raises(TypeError, match="numpy array"):
        persistent.all_reduce([1.0, 2.0])
    with pytest.raises(TypeError, match="BAND"):
        persistent.all_reduce(np.zeros(2), op=dist.ReduceOp.BAND)
    with pytest.raises(ValueError, match="expected world_size"):
        persistent.all_gather_into_tensor(np.zeros(dist.get_world_size() + 1), np.zeros(1))
