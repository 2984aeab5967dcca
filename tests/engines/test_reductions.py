"""Reductions (all_reduce, reduce, reduce_scatter, reduce_scatter_tensor,
all_reduce_coalesced): every dtype x every ReduceOp x layouts x groups x sync/async,
checked against numpy on every rank."""

import numpy as np
import pytest
from conftest import all_dtypes
from refs import (
    LAYOUTS,
    PREMUL_FACTOR,
    REDUCE_OPS,
    assert_equal,
    buffer,
    make,
    reduce_ref,
    shape_of,
    supported,
)

pytestmark = pytest.mark.mpi
DTYPES = all_dtypes()


def _op(dist, name):
    if name == "PREMUL_SUM":
        return dist.make_premul_sum(PREMUL_FACTOR)
    return getattr(dist.ReduceOp, name)


def _finish(work, async_op):
    if async_op:
        assert work is not None
        assert work.wait() is True
        assert work.is_completed() and work.is_success() and work.exception() is None
    else:
        assert work is None


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("group_kind", ["world", "parity"])
@pytest.mark.parametrize("opname", REDUCE_OPS)
def test_all_reduce(dist, groups, opname, group_kind, async_op, layout):
    pg = groups[group_kind]
    members = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    for dt in DTYPES:
        x, base, mask = buffer(layout, dt)
        x[...] = make(me, shape_of(layout), dt, opname)
        outside = base[~mask].copy()
        if not supported(dt, opname):
            with pytest.raises(TypeError, match=f"all_reduce: .*{dt.name if dt.name != 'bool' else 'bool'}"):
                dist.all_reduce(x, op=_op(dist, opname), group=pg, async_op=async_op)
            continue
        expect = reduce_ref([make(r, shape_of(layout), dt, opname) for r in members], opname, dt)
        _finish(dist.all_reduce(x, op=_op(dist, opname), group=pg, async_op=async_op), async_op)
        assert_equal(np.asarray(x), expect, f"{opname} {dt}")
        np.testing.assert_array_equal(base[~mask], outside)  # the rest of the base untouched


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("group_kind", ["world", "parity"])
@pytest.mark.parametrize("opname", REDUCE_OPS)
def test_reduce(dist, groups, opname, group_kind, async_op):
    pg = groups[group_kind]
    members = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    for root_index, layout in ((0, "contig"), (len(members) - 1, "strided")):
        root = members[root_index]
        for dt in DTYPES:
            x, _, _ = buffer(layout, dt)
            x[...] = make(me, shape_of(layout), dt, opname)
            before = x.copy()
            if not supported(dt, opname):
                with pytest.raises(TypeError):
                    dist.reduce(x, dst=root, op=_op(dist, opname), group=pg, async_op=async_op)
                continue
            expect = reduce_ref([make(r, shape_of(layout), dt, opname) for r in members], opname, dt)
            # group_dst names the same root by its group rank
            kwargs = {"dst": root} if root_index == 0 else {"group_dst": root_index}
            work = dist.reduce(x, op=_op(dist, opname), group=pg, async_op=async_op, **kwargs)
            _finish(work, async_op)
            if me == root:
                assert_equal(x, expect, f"{opname} {dt}")
            else:
                np.testing.assert_array_equal(x, before)  # non-roots keep their input


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("group_kind", ["world", "parity"])
@pytest.mark.parametrize("opname", REDUCE_OPS)
def test_reduce_scatter_tensor(dist, groups, opname, group_kind, async_op):
    pg = groups[group_kind]
    members = dist.get_process_group_ranks(pg)
    n, me, gr = len(members), dist.get_rank(), pg.rank()
    for dt in DTYPES:
        x = make(me, (n * 2, 3), dt, opname)
        out = np.zeros((2, 3), dt)
        if not supported(dt, opname):
            with pytest.raises(TypeError):
                dist.reduce_scatter_tensor(out, x, op=_op(dist, opname), group=pg, async_op=async_op)
            continue
        full = reduce_ref([make(r, (n * 2, 3), dt, opname) for r in members], opname, dt)
        _finish(dist.reduce_scatter_tensor(out, x, op=_op(dist, opname), group=pg,
                                           async_op=async_op), async_op)
        assert_equal(out, full[2 * gr:2 * gr + 2], f"{opname} {dt}")
        # strided output view, flat input
        base = np.zeros((2, 6), dt)
        view = base[:, ::2]
        _finish(dist.reduce_scatter_tensor(view, x.reshape(-1), op=_op(dist, opname), group=pg,
                                           async_op=async_op), async_op)
        assert_equal(view, full[2 * gr:2 * gr + 2], f"{opname} {dt} strided")
        assert not base[:, 1::2].any()


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("group_kind", ["world", "parity"])
@pytest.mark.parametrize("opname", REDUCE_OPS)
def test_reduce_scatter_uneven(dist, groups, opname, group_kind, async_op):
    """input_list[i] has i+1 elements: rank i's output is the reduction of those."""
    pg = groups[group_kind]
    members = dist.get_process_group_ranks(pg)
    n, me, gr = len(members), dist.get_rank(), pg.rank()
    for dt in DTYPES:
        ins = [make(me, (i + 1,), dt, opname, salt=i) for i in range(n)]
        out = np.zeros(gr + 1, dt)
        if not supported(dt, opname):
            with pytest.raises(TypeError):
                dist.reduce_scatter(out, ins, op=_op(dist, opname), group=pg, async_op=async_op)
            continue
        expect = reduce_ref([make(r, (gr + 1,), dt, opname, salt=gr) for r in members], opname, dt)
        _finish(dist.reduce_scatter(out, ins, op=_op(dist, opname), group=pg, async_op=async_op),
                async_op)
        assert_equal(out, expect, f"{opname} {dt}")


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("opname", REDUCE_OPS)
def test_all_reduce_coalesced(dist, groups, opname, async_op):
    """Arrays of several dtypes and shapes, one of them a strided view, in one call."""
    pg = groups["world"]
    members = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    dts = [dt for dt in DTYPES if supported(dt, opname)]
    shapes = [(4,), (2, 3), (), (0,)]
    arrays, expects = [], []
    for dt in dts:
        for s, shape in enumerate(shapes):
            arrays.append(make(me, shape, dt, opname, salt=s))
            expects.append(reduce_ref([make(r, shape, dt, opname, salt=s) for r in members],
                                      opname, dt))
        base = np.zeros((2, 8), dt)
        view = base[:, ::2]
        view[...] = make(me, (2, 4), dt, opname, salt=9)
        arrays.append(view)
        expects.append(reduce_ref([make(r, (2, 4), dt, opname, salt=9) for r in members],
                                  opname, dt))
    result = dist.all_reduce_coalesced(arrays, op=_op(dist, opname), group=pg, async_op=async_op)
    if async_op:  # a Future, as in torch, whose value is the list of arrays
        assert isinstance(result, dist.Future)
        assert all(a is b for a, b in zip(result.wait(), arrays))
    else:
        assert result is None
    for got, expect in zip(arrays, expects):
        assert_equal(np.asarray(got), expect, f"{opname} {got.dtype}")
    bad = [dt for dt in DTYPES if not supported(dt, opname)]
    if bad:
        before = arrays[0].copy()
        with pytest.raises(TypeError):
            dist.all_reduce_coalesced([arrays[0], np.ones(3, bad[0])], op=_op(dist, opname))
        np.testing.assert_array_equal(arrays[0], before)  # nothing was reduced


def test_premul_sum_factor_forms(dist):
    """The factor may be a numpy scalar or a one-element array, read at call time."""
    n = dist.get_world_size()
    factor = np.array([2.0])
    op = dist.make_premul_sum(factor)
    x = np.ones(4, np.float32)
    dist.all_reduce(x, op=op)
    np.testing.assert_array_equal(x, np.full(4, 2.0 * n, np.float32))
    factor[0] = 3.0
    x = np.ones(4, np.float64)
    dist.all_reduce(x, op=op)
    np.testing.assert_array_equal(x, np.full(4, 3.0 * n))
    x = np.ones(2, np.complex64)
    dist.all_reduce(x, op=dist.make_premul_sum(1j))
    np.testing.assert_array_equal(x, np.full(2, 1j * n, np.complex64))
    with pytest.raises(TypeError, match="complex PREMUL_SUM factor"):
        dist.all_reduce(np.ones(2, np.float32), op=dist.make_premul_sum(1j))
    with pytest.raises(TypeError):
        dist.make_premul_sum("2")


def test_float16_accumulates_in_float32(dist):
    """float16 sums are rounded once: 2048 + 1 + ... is not lost to float16 rounding."""
    n = dist.get_world_size()
    me = dist.get_rank()
    x = np.array([2048.0 if me == 0 else 1.0], np.float16)
    dist.all_reduce(x)
    expect = np.float16(np.float32(2048.0) + np.float32(n - 1))
    assert x[0] == expect
