"""spmd.BucketReducer under MPI: results against a numpy reference on every rank,
DDP's bucket assignment (checked against torch's own function), compression, errors."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ml_dtypes

import spmd

pytestmark = pytest.mark.mpi

SHAPES = [(7, 3), (3,), (16, 16), (16,), (5, 4, 2), (1,), (33,)]


def rank_grads(rank, dtypes=(np.float64,), step=0):
    """This rank's gradients: different on every rank and step, same shapes everywhere."""
    rng = np.random.default_rng(1000 * step + rank)
    out = []
    for k, shape in enumerate(SHAPES):
        dt = np.dtype(dtypes[k % len(dtypes)])
        g = rng.standard_normal(shape) * 4
        out.append(np.round(g).astype(dt) if dt.kind == "i" else g.astype(dt))
    return out


def reference(group, dtypes=(np.float64,), step=0, op="avg"):
    """The reduction of every rank's gradients, computed locally."""
    ranks = group.ranks if group is not None else range(spmd.get_world_size())
    per_rank = [rank_grads(r, dtypes, step) for r in ranks]
    out = []
    for parts in zip(*per_rank):
        total = np.sum([p.astype(np.float64) for p in parts], axis=0)
        if op == "avg":
            total = total / len(parts)
            if parts[0].dtype.kind == "i":
                total = np.trunc(total)
        out.append(total.astype(parts[0].dtype))
    return out


@pytest.mark.parametrize("as_view", [False, True])
@pytest.mark.parametrize("cap", [1e-9, 0.0005, 25.0])
@pytest.mark.parametrize("gname", ["world", "parity"])
def test_reduces_like_numpy(dist, groups, cap, gname, as_view):
    """Several steps on the same reducer; ranks mark the gradients in different orders
    (the buckets still start in the same order everywhere)."""
    pg = groups[gname]
    group = None if gname == "world" else pg
    given = [np.full(s, 7.0) for s in SHAPES]
    reducer = spmd.BucketReducer(given, bucket_cap_mb=cap, group=group,
                                 first_bucket_cap_mb=cap / 2, gradient_as_bucket_view=as_view)
    grads = reducer.grads
    for bucket in reducer.buckets:
        for i in bucket:  # in buckets of several gradients, views into the bucket buffer
            assert (grads[i] is given[i]) == (not as_view or len(bucket) == 1)
            assert (grads[i] == 7.0).all() and grads[i].shape == SHAPES[i]
    assert as_view is False or cap == 1e-9 or any(g is not h for g, h in zip(grads, given))
    if cap == 1e-9:
        assert reducer.buckets == [[i] for i in reversed(range(len(SHAPES)))]
    if cap == 25.0:
        assert len(reducer.buckets) == 1
    order = np.random.default_rng(dist.get_rank()).permutation(len(SHAPES))
    for step in range(3):
        for g, v in zip(grads, rank_grads(dist.get_rank(), step=step)):
            g[...] = v
        for i in order:
            reducer.mark_ready(int(i))
        reducer.wait()
        for g, ref in zip(grads, reference(group, step=step)):
            np.testing.assert_allclose(g, ref, rtol=1e-13, atol=1e-13)


def test_mixed_dtypes_strided_sum(dist):
    """float32, float64 and int32 gradients (one dtype per bucket), strided views, SUM."""
    dtypes = (np.float32, np.float64, np.int32)
    # Every other element of a base array (strided), and a transposed view.
    bases = [np.zeros(s + (2,), np.dtype(dtypes[k % 3])) for k, s in enumerate(SHAPES)]
    grads = [b[..., k % 2] for k, b in enumerate(bases)]
    square = np.zeros((16, 16), np.dtype(dtypes[2]))
    grads[2] = square.T
    assert not any(g.flags.c_contiguous for g in grads if g.size > 1)
    reducer = spmd.BucketReducer(grads, bucket_cap_mb=0.0004, op=spmd.ReduceOp.SUM)
    for b in reducer.buckets:
        assert len({grads[i].dtype for i in b}) == 1
    for g, v in zip(grads, rank_grads(dist.get_rank(), dtypes)):
        g[...] = v
    for i in reversed(range(len(grads))):
        reducer.mark_ready(i)
    reducer.wait()
    for g, ref in zip(grads, reference(None, dtypes, op="sum")):
        f32 = ref.dtype == np.float32  # sums of 4 float32 values of size ~10
        np.testing.assert_allclose(g, ref, rtol=1e-6 if f32 else 1e-13, atol=1e-5 if f32 else 0)
    np.testing.assert_array_equal(square, reference(None, dtypes, op="sum")[2].T)
    for k, b in enumerate(bases):  # the other halves of the bases untouched
        np.testing.assert_array_equal(b[..., 1 - k % 2], 0)


def test_assignment_matches_torch(dist):
    """The buckets are those of DDP's (rebuilt) assignment, from torch itself."""
    pytest.importorskip("torch.distributed", reason="torch gives the reference bucket assignment")
    import torch
    import torch.distributed as tdist

    rng = np.random.default_rng(5)
    for trial in range(20):
        n = int(rng.integers(1, 30))
        sizes = rng.integers(1, 3000, n)
        dts = [np.float32 if trial % 3 else [np.float32, np.float64][k % 2] for k in range(n)]
        grads = [np.zeros(int(s), dt) for s, dt in zip(sizes, dts)]
        first, cap = int(rng.integers(100, 5000)), int(rng.integers(100, 20000))
        ours = spmd.BucketReducer(grads, bucket_cap_mb=cap / 2**20,
                                  first_bucket_cap_mb=first / 2**20).buckets
        tensors = [torch.from_numpy(g) for g in grads]
        theirs, _ = tdist._compute_bucket_assignment_by_size(
            list(reversed(tensors)), [first, cap], [False] * n, list(reversed(range(n))))
        assert sorted(ours) == sorted(theirs), (trial, ours, theirs)
        # Started in the order backward fills them: the last gradients first.
        assert [b[0] for b in ours] == sorted((b[0] for b in ours), reverse=True)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compression(dist, compression):
    if compression == "bf16" and ml_dtypes is None:
        pytest.skip("bf16 compression needs ml_dtypes")
    wire = np.float16 if compression == "fp16" else ml_dtypes.bfloat16
    grads = [np.empty(s, np.float32) for s in SHAPES]
    reducer = spmd.BucketReducer(grads, bucket_cap_mb=0.0005, compression=compression)
    mine = rank_grads(dist.get_rank(), (np.float32,))
    for g, v in zip(grads, mine):
        g[...] = v
    for i in reversed(range(len(grads))):
        reducer.mark_ready(i)
    reducer.wait()
    n = dist.get_world_size()
    per_rank = [rank_grads(r, (np.float32,)) for r in range(n)]
    for k, g in enumerate(grads):
        # Each rank's values rounded to the wire dtype, averaged: one more rounding at most.
        ref = np.mean([p[k].astype(wire).astype(np.float64) for p in per_rank], axis=0)
        np.testing.assert_allclose(g, ref, rtol=2 ** -(7 if compression == "bf16" else 10))
        # What arrived went over the wire in the compressed dtype.
        np.testing.assert_array_equal(g.astype(wire).astype(np.float32), g)
        assert g.dtype == np.float32


def test_errors_same_on_every_rank(dist):
    rank = dist.get_rank()
    suffix = rf"\[rank {rank}, group WORLD\]"
    grads = [np.zeros(3), np.zeros(4)]
    reducer = spmd.BucketReducer(grads, bucket_cap_mb=1e-9)
    reducer.mark_ready(1)
    with pytest.raises(RuntimeError, match=r"BucketReducer.mark_ready: grads\[1\] was already "
                       r"marked ready in this step .*" + suffix):
        reducer.mark_ready(1)
    with pytest.raises(RuntimeError, match=r"BucketReducer.wait: 1 of 2 gradients were not "
                       r"marked ready in this step \(grads 0\).*" + suffix):
        reducer.wait()
    with pytest.raises(ValueError, match=r"index 2 is out of range: expected 0 <= index < 2"):
        reducer.mark_ready(2)
    with pytest.raises(TypeError, match=r"index must be an int, got str"):
        reducer.mark_ready("0")
    reducer.mark_ready(0)  # the step can still be finished
    reducer.wait()
    cases = [
        (lambda: spmd.BucketReducer([]), ValueError, "grads is empty"),
        (lambda: spmd.BucketReducer([np.zeros(2), [1.0]]), TypeError,
         r"grads\[1\] must be a numpy or cupy array, got list"),
        (lambda: spmd.BucketReducer([np.zeros(2, np.int64)], compression="bf16"), TypeError,
         r"casts floating-point gradients, but grads\[0\] has dtype int64"),
        (lambda: spmd.BucketReducer([np.zeros(2)], compression="int8"), ValueError,
         r"compression must be None, 'bf16' or 'fp16', got 'int8'"),
        (lambda: spmd.BucketReducer([np.zeros(2)], bucket_cap_mb=0), ValueError,
         r"bucket_cap_mb must be a positive number, got 0"),
        (lambda: spmd.BucketReducer([np.zeros(2, object)]), TypeError, "unsupported dtype object"),
    ]
    base = np.zeros(10)
    cases.append((lambda: spmd.BucketReducer([base[:6], base[4:]]), ValueError,
                  r"grads\[0\] and grads\[1\] share memory"))
    ro = np.zeros(3)
    ro.flags.writeable = False
    cases.append((lambda: spmd.BucketReducer([ro]), ValueError, r"grads\[0\] is read-only"))
    for make, exc, match in cases:
        with pytest.raises(exc, match=match + ".*" + suffix):
            make()
    # Interleaved views do not share memory: accepted.
    spmd.BucketReducer([base[::2], base[1::2]])


@pytest.mark.parametrize("compression", [None, "fp16"])
def test_cupy_gradients(dist, compression):
    from _gpu_helpers import cupy

    cp = cupy()
    grads = [cp.asarray(g) for g in rank_grads(dist.get_rank(), (np.float32,))]
    reducer = spmd.BucketReducer(grads, bucket_cap_mb=0.0005, compression=compression)
    for i in reversed(range(len(grads))):
        reducer.mark_ready(i)
    reducer.wait()
    tol = 2 ** -10 if compression else 1e-6
    for g, ref in zip(grads, reference(None, (np.float32,))):
        np.testing.assert_allclose(cp.asnumpy(g), ref, rtol=tol, atol=1e-5)
