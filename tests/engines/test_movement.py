"""Data-movement collectives: broadcast, all_gather*, gather, scatter, all_to_all*,
barrier; every dtype, even and uneven sizes, views, groups, sync and async."""

import numpy as np
import pytest
from conftest import all_dtypes
from refs import LAYOUTS, buffer, make, shape_of

pytestmark = pytest.mark.mpi
DTYPES = all_dtypes()
GROUPS = ["world", "parity"]


def _finish(work, async_op):
    if async_op:
        assert work.wait() is True and work.is_completed()
    else:
        assert work is None


def _same(got, expect):
    assert got.dtype == expect.dtype and got.shape == expect.shape, (got.dtype, got.shape, expect.shape)
    # compare bit patterns: exact, and defined for bfloat16 too
    bits = np.dtype(f"u{got.dtype.itemsize}") if got.dtype.kind != "c" else np.dtype(f"u{got.dtype.itemsize // 2}")
    np.testing.assert_array_equal(np.ascontiguousarray(got).view(bits), np.ascontiguousarray(expect).view(bits))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("group_kind", GROUPS)
def test_broadcast(dist, groups, group_kind, async_op, layout):
    pg = groups[group_kind]
    members = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    for src_index in range(len(members)):
        src = members[src_index]
        for dt in DTYPES:
            x, base, mask = buffer(layout, dt)
            x[...] = make(me, shape_of(layout), dt)
            outside = base[~mask].copy()
            kwargs = {"src": src} if src_index % 2 == 0 else {"group_src": src_index}
            _finish(dist.broadcast(x, group=pg, async_op=async_op, **kwargs), async_op)
            _same(np.asarray(x), make(src, shape_of(layout), dt))
            _same(base[~mask], outside)


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("group_kind", GROUPS)
@pytest.mark.parametrize("uneven", [False, True])
def test_all_gather(dist, groups, group_kind, async_op, uneven):
    pg = groups[group_kind]
    members = dist.get_process_group_ranks(pg)
    me, gr = dist.get_rank(), pg.rank()
    rows = (lambda i: i) if uneven else (lambda i: 2)  # rank i sends i rows (rank 0: none)
    for dt in DTYPES:
        x = make(me, (rows(gr), 3), dt)
        outs = [np.zeros((rows(i), 3), dt) for i in range(len(members))]
        outs[-1] = np.zeros((rows(len(members) - 1), 6), dt)[:, ::2]  # a strided output
        _finish(dist.all_gather(outs, x, group=pg, async_op=async_op), async_op)
        for i, r in enumerate(members):
            _same(outs[i], make(r, (rows(i), 3), dt))


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("group_kind", GROUPS)
@pytest.mark.parametrize("form", ["concat", "stacked", "strided_in", "strided_out"])
def test_all_gather_into_tensor(dist, groups, group_kind, async_op, form):
    pg = groups[group_kind]
    members = dist.get_process_group_ranks(pg)
    n, me = len(members), dist.get_rank()
    for dt in DTYPES:
        x = make(me, (2, 3), dt)
        expect = np.concatenate([make(r, (2, 3), dt) for r in members])
        if form == "concat":
            out = np.zeros((2 * n, 3), dt)
        elif form == "stacked":
            out = np.zeros((n, 2, 3), dt)
            expect = expect.reshape(n, 2, 3)
        elif form == "strided_in":
            base = np.zeros((2, 6), dt)
            base[:, ::2] = x
            x = base[:, ::2]
            out = np.zeros((2 * n, 3), dt)
        else:
            base = np.zeros((2 * n, 6), dt)
            out = base[:, ::2]
        _finish(dist.all_gather_into_tensor(out, x, group=pg, async_op=async_op), async_op)
        _same(np.asarray(out), expect)


@pytest.mark.parametrize("async_op", [False, True])
def test_all_gather_coalesced(dist, groups, async_op):
    pg = groups["parity"]
    members = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    specs = [(dt, shape) for dt in DTYPES for shape in ((3,), (2, 2), ())]
    ins = [make(me, shape, dt, salt=k) for k, (dt, shape) in enumerate(specs)]
    ins[0] = np.repeat(ins[0], 2)[::2]  # a strided input
    outs = [[np.zeros(shape, dt) for dt, shape in specs] for _ in members]
    result = dist.all_gather_coalesced(outs, ins, group=pg, async_op=async_op)
    if async_op:  # a Future, as in torch, whose value is output_tensor_lists
        assert isinstance(result, dist.Future)
        value = result.wait()
        assert all(a is b for va, oa in zip(value, outs) for a, b in zip(va, oa))
    else:
        assert result is None
    for i, r in enumerate(members):
        for k, (dt, shape) in enumerate(specs):
            _same(outs[i][k], make(r, shape, dt, salt=k))


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("group_kind", GROUPS)
def test_gather(dist, groups, group_kind, async_op):
    pg = groups[group_kind]
    members = dist.get_process_group_ranks(pg)
    me, n = dist.get_rank(), len(members)
    for root_index in range(n):
        root = members[root_index]
        for dt in DTYPES:
            x = make(me, (2, 2), dt)
            outs = [np.zeros((2, 2), dt) for _ in range(n)] if me == root else None
            if outs:
                outs[0] = np.zeros((2, 4), dt)[:, ::2]
            kwargs = {"dst": root} if root_index % 2 else {"group_dst": root_index}
            _finish(dist.gather(x, outs, group=pg, async_op=async_op, **kwargs), async_op)
            if me == root:
                for i, r in enumerate(members):
                    _same(outs[i], make(r, (2, 2), dt))


def test_gather_scatter_default_root_is_global_rank_0(dist):
    me, n = dist.get_rank(), dist.get_world_size()
    x = np.full(2, me, np.int64)
    outs = [np.zeros(2, np.int64) for _ in range(n)] if me == 0 else None
    dist.gather(x, outs)
    if me == 0:
        assert [int(o[0]) for o in outs] == list(range(n))
    y = np.zeros(2, np.int64)
    dist.scatter(y, [np.full(2, 10 + i, np.int64) for i in range(n)] if me == 0 else None)
    assert list(y) == [10 + me] * 2


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("group_kind", GROUPS)
def test_scatter(dist, groups, group_kind, async_op):
    pg = groups[group_kind]
    members = dist.get_process_group_ranks(pg)
    me, n, gr = dist.get_rank(), len(members), pg.rank()
    for root_index in range(n):
        root = members[root_index]
        for dt in DTYPES:
            ins = [make(root, (3,), dt, salt=i) for i in range(n)] if me == root else None
            out = np.zeros(6, dt)[::2]
            kwargs = {"src": root} if root_index % 2 else {"group_src": root_index}
            _finish(dist.scatter(out, ins, group=pg, async_op=async_op, **kwargs), async_op)
            _same(np.asarray(out), make(root, (3,), dt, salt=gr))


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("group_kind", GROUPS)
def test_all_to_all_uneven(dist, groups, group_kind, async_op):
    """Group rank i sends (i + j) % 3 rows to group rank j."""
    pg = groups[group_kind]
    members = dist.get_process_group_ranks(pg)
    n, gr = len(members), pg.rank()
    for dt in DTYPES:
        ins = [make(members[gr], ((gr + j) % 3, 2), dt, salt=j) for j in range(n)]
        outs = [np.zeros(((i + gr) % 3, 2), dt) for i in range(n)]
        _finish(dist.all_to_all(outs, ins, group=pg, async_op=async_op), async_op)
        for i in range(n):
            _same(outs[i], make(members[i], ((i + gr) % 3, 2), dt, salt=gr))


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("group_kind", GROUPS)
@pytest.mark.parametrize("splits", [False, True])
def test_all_to_all_single(dist, groups, group_kind, async_op, splits):
    pg = groups[group_kind]
    members = dist.get_process_group_ranks(pg)
    n, gr = len(members), pg.rank()
    for dt in DTYPES:
        if not splits:
            x = make(members[gr], (2 * n, 3), dt)
            out = np.zeros((2 * n, 3), dt)
            _finish(dist.all_to_all_single(out, x, group=pg, async_op=async_op), async_op)
            expect = np.concatenate([make(members[i], (2 * n, 3), dt)[2 * gr:2 * gr + 2]
                                     for i in range(n)])
        else:
            # rank i sends (i + j) % 3 rows to rank j
            send = [(gr + j) % 3 for j in range(n)]
            recv = [(i + gr) % 3 for i in range(n)]

            def rows_of(i):
                # called in this iteration only, so the loop's dt is the right one
                return make(members[i], (sum((i + j) % 3 for j in range(n)), 3), dt)  # noqa: B023

            x = rows_of(gr)
            out = np.zeros((sum(recv) , 6), dt)[:, ::2]  # strided output
            _finish(dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send,
                                           group=pg, async_op=async_op), async_op)
            parts = []
            for i in range(n):
                start = sum((i + j) % 3 for j in range(gr))
                parts.append(rows_of(i)[start:start + (i + gr) % 3])
            expect = np.concatenate(parts)
        _same(np.asarray(out), expect)


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("group_kind", GROUPS)
def test_barrier(dist, groups, group_kind, async_op):
    pg = groups[group_kind]
    # A value broadcast after the barrier proves the ranks passed it together.
    work = dist.barrier(group=pg, async_op=async_op)
    _finish(work, async_op)
    x = np.array([pg.rank()])
    dist.broadcast(x, group_src=0, group=pg)
    assert x[0] == 0
