"""Fusion: coalescing_manager() and all_reduce_coalesced give what separate calls give,
across dtypes, shapes, views, buckets and reduce ops; misuse raises before sending."""

import numpy as np
import pytest

from spmd.api import coalescing

pytestmark = pytest.mark.mpi


def _arrays(rank, count=20):
    """Arrays of several dtypes and shapes, some non-contiguous views."""
    out = []
    for k in range(count):
        dt = (np.float32, np.float64, np.int32, np.int64)[k % 4]
        shape = ((k % 5) + 1,) if k % 3 else (2, (k % 4) + 1)
        out.append((np.arange(np.prod(shape), dtype=dt).reshape(shape) + rank + k).astype(dt))
    base = np.arange(12.0).reshape(3, 4) + rank
    out.append(base[:, ::2])                 # a view that is not contiguous
    out.append(np.zeros(0, np.float32))      # empty
    return out


@pytest.mark.parametrize("opname", ["SUM", "MAX", "AVG"])
def test_manager_equals_separate_all_reduces(dist, opname):
    op = getattr(dist.ReduceOp, opname)
    rank = dist.get_rank()
    fused, ref = _arrays(rank), _arrays(rank)
    for a in ref:
        dist.all_reduce(a, op=op)
    with dist.coalescing_manager() as cm:
        for a in fused:
            assert dist.all_reduce(a, op=op) is None
    assert cm.work is not None and cm.work.is_completed()
    for a, b in zip(fused, ref):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_manager_async_and_pending_placeholders(dist):
    n = dist.get_world_size()
    xs = [np.full(3, float(k)) for k in range(10)]
    with dist.coalescing_manager(async_ops=True) as cm:
        pending = [dist.all_reduce(x, async_op=True) for x in xs]
    cm.wait()
    assert all(p.is_completed() and p.is_success() for p in pending)
    assert len(cm.works) == 1
    for k, x in enumerate(xs):
        np.testing.assert_array_equal(x, np.full(3, float(k * n)))


def test_many_arrays_in_buckets(dist):
    """256 arrays of 1 KiB over several buckets (the datatype path and the threshold)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    xs = [np.full(256, rank + k, np.float32) for k in range(256)]
    old = coalescing.get_bucket_bytes()
    coalescing.set_bucket_bytes(40 * 1024)  # 40 arrays per bucket: 7 buckets
    try:
        work = dist.all_reduce_coalesced(xs, async_op=True)
        work.wait()
    finally:
        coalescing.set_bucket_bytes(old)
    base = n * (n - 1) // 2
    for k, x in enumerate(xs):
        np.testing.assert_array_equal(x, np.full(256, base + n * k, np.float32))


def test_buckets_split_by_threshold():
    xs = [np.zeros(k, np.uint8) for k in (10, 10, 30, 5, 100, 1)]
    runs = coalescing.buckets(xs, 25)
    assert [[x.size for x in r] for r in runs] == [[10, 10], [30], [5], [100], [1]]
    assert coalescing.buckets([], 10) == []
    with pytest.raises(ValueError):
        coalescing.set_bucket_bytes(0)
    with pytest.raises(TypeError):
        coalescing.set_bucket_bytes(1.5)


def test_pack_buckets_roundtrip():
    """Packed buffers go back where they came from (in-place buckets are the arrays)."""
    xs = [np.arange(k + 1, dtype=np.float64) * (k + 1) for k in range(30)]
    packed = coalescing.pack_buckets(xs, np.dtype(np.float64), limit=100)
    assert sum(1 if p.arrays is None else len(p.arrays) for p in packed) == 30
    for p in packed:
        p.buf *= 2
        p.unpack()
    for k, x in enumerate(xs):
        np.testing.assert_array_equal(x, np.arange(k + 1) * (k + 1) * 2)


def _gather_input(j, r):
    return [np.array([r, r + 0.5]), np.arange(3, dtype=np.int32) + 10 * r,
            np.full((2, 2), r, np.float32)][j]


def test_manager_all_gather_and_reduce_scatter(dist):
    n, rank = dist.get_world_size(), dist.get_rank()
    outs = [np.zeros((n, 2), np.float64), np.zeros(3 * n, np.int32),
            np.zeros((2 * n, 3), np.float32)[:, ::2]]   # the last one is a view
    with dist.coalescing_manager() as cm:
        for j, o in enumerate(outs):
            dist.all_gather_into_tensor(o, _gather_input(j, rank))
    assert len(cm.works) == 1
    for j, o in enumerate(outs):
        ref = np.concatenate([_gather_input(j, r).reshape(-1) for r in range(n)])
        np.testing.assert_array_equal(o.reshape(-1), ref)

    outs = [np.zeros(2, np.float64), np.zeros((1, 3), np.float64), np.zeros(2, np.int64)]
    ins = [np.arange(2 * n, dtype=np.float64) + rank, np.ones((n, 3)) * rank,
           np.arange(2 * n, dtype=np.int64)]
    with dist.coalescing_manager() as cm:
        for o, i in zip(outs, ins):
            dist.reduce_scatter_tensor(o, i)
    assert len(cm.works) == 2  # one per dtype
    total = n * (n - 1) // 2
    np.testing.assert_array_equal(outs[0], n * np.arange(2 * rank, 2 * rank + 2) + total)
    np.testing.assert_array_equal(outs[1], np.full((1, 3), float(total)))
    np.testing.assert_array_equal(outs[2], n * np.arange(2 * rank, 2 * rank + 2))


def test_manager_refuses_mixes_and_other_ops(dist):
    x = np.ones(2)
    with pytest.raises(ValueError, match="same collective"):
        with dist.coalescing_manager():
            dist.all_reduce(x)
            dist.all_gather_into_tensor(np.zeros(2 * dist.get_world_size()), x)
    with pytest.raises(ValueError, match="same ReduceOp"):
        with dist.coalescing_manager():
            dist.all_reduce(x)
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
    with pytest.raises(ValueError, match="cannot run inside coalescing_manager"):
        with dist.coalescing_manager():
            dist.broadcast(x, src=0)
    with pytest.raises(RuntimeError, match="do not nest"):
        with dist.coalescing_manager():
            with dist.coalescing_manager():
                pass
    # after every failure the group works normally again, and nothing was sent
    dist.all_reduce(x)
    np.testing.assert_array_equal(x, np.full(2, float(dist.get_world_size())))


def test_empty_block_and_empty_arrays(dist):
    with dist.coalescing_manager() as cm:
        pass
    assert cm.works == [] and cm.work is None
    e = np.zeros(0)
    dist.all_reduce_coalesced([e, np.ones(1)])
    assert e.size == 0



def test_block_on_a_group_this_rank_is_not_in(dist):
    """Non-members get a manager whose ops return None without sending; it still prints."""
    me = dist.get_rank()
    g = dist.new_group([0])
    x = np.full(2, float(me))
    if me == 0:
        with dist.coalescing_manager(group=g) as cm:
            dist.all_reduce(x, group=g)
        assert len(cm.works) == 1 and "NON_GROUP_MEMBER" not in repr(cm)
        dist.destroy_process_group(g)
    else:
        with pytest.warns(UserWarning, match="does not belong"):
            with dist.coalescing_manager(group=g) as cm:
                assert dist.all_reduce(x, group=g) is None
        assert cm.works == [] and "group=NON_GROUP_MEMBER" in repr(cm)
    np.testing.assert_array_equal(x, np.full(2, float(me)))  # a group of one: unchanged
