"""Checks of the shared-memory engine, shared by tests/engines/test_shm.py (under pytest-mpi)
and tests/programs/shm_nodes.py (pseudo-node jobs).

Every check runs on every rank of the group and asserts the same things: results
against numpy references (exact for integers and bool), and, for floats, the same bits
on every rank.
"""

from __future__ import annotations

import os

import numpy as np
from refs import PREMUL_FACTOR, REDUCE_OPS, assert_equal, family, make, reduce_ref, supported

LAYOUTS = ("contig", "strided", "scalar")


def engine_group(dist, ranks=None, *, slot_bytes=None, one_shot_max=None, split=None,
                 timeout=None):
    """A group (of ``ranks``, or this rank's part of ``split``) whose engine runs at every
    size, with ``slot_bytes`` slots and one-shot up to ``one_shot_max`` bytes.

    Every rank of WORLD calls it; returns None on ranks outside the group.
    """
    saved = os.environ.get("SPMD_SHM")
    os.environ["SPMD_SHM"] = "force"
    try:
        if split is not None:
            pg = dist.split_group(split_ranks=split, timeout=timeout)
        else:
            pg = dist.new_group(ranks, timeout=timeout)
        if not pg:
            return None
        dist.barrier(group=pg)  # makes the backend, which reads SPMD_SHM
    finally:
        if saved is None:
            os.environ.pop("SPMD_SHM", None)
        else:
            os.environ["SPMD_SHM"] = saved
    engine = pg.engine_for("cpu").shm
    assert engine is not None and engine.mode == "force"
    if slot_bytes is not None:
        engine.slot_bytes = slot_bytes
    if one_shot_max is not None:
        engine.one_shot_max = one_shot_max
    return pg


def engine_of(pg):
    return pg.engine_for("cpu").shm


def op_of(dist, name):
    if name == "PREMUL_SUM":
        return dist.make_premul_sum(PREMUL_FACTOR)
    return getattr(dist.ReduceOp, name)


def buffer(layout: str, dt, shape=(13, 17)):
    """(array to pass, base it views, mask of base elements the array covers)."""
    dt = np.dtype(dt)
    if layout == "contig":
        base = np.zeros(shape, dt)
        return base, base, np.ones(shape, bool)
    if layout == "strided":
        base = np.zeros((shape[0], 2 * shape[1]), dt)
        mask = np.zeros(base.shape, bool)
        mask[:, 1::2] = True
        return base[:, 1::2], base, mask
    base = np.zeros((), dt)
    return base, base, np.ones((), bool)


def finish(work, async_op: bool) -> None:
    if async_op:
        assert work is not None and work.wait() is True
        assert work.is_completed() and work.is_success()
    else:
        assert work is None


def check_all_reduce(dist, pg, dtypes, ops=REDUCE_OPS, layouts=LAYOUTS, shape=(13, 17)):
    """Every dtype x op x layout x (sync, async) against numpy; untouched memory stays so."""
    members = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    for async_op in (False, True):
        for layout in layouts:
            for opname in ops:
                for dt in dtypes:
                    if not supported(dt, opname):
                        continue
                    x, base, mask = buffer(layout, dt, shape)
                    shp = x.shape
                    x[...] = make(me, shp, dt, opname)
                    base[~mask] = 1
                    expect = reduce_ref([make(r, shp, dt, opname) for r in members], opname, dt)
                    work = dist.all_reduce(x, op=op_of(dist, opname), group=pg, async_op=async_op)
                    finish(work, async_op)
                    assert_equal(np.asarray(x), expect, f"all_reduce {opname} {dt} {layout}")
                    assert (base[~mask] == 1).all()


def check_reduce(dist, pg, dtypes, ops=REDUCE_OPS, shape=(13, 17)):
    members = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    for root_index, layout in ((0, "contig"), (len(members) - 1, "strided")):
        root = members[root_index]
        for opname in ops:
            for dt in dtypes:
                if not supported(dt, opname):
                    continue
                x, _, _ = buffer(layout, dt, shape)
                x[...] = make(me, x.shape, dt, opname)
                before = x.copy()
                expect = reduce_ref([make(r, x.shape, dt, opname) for r in members], opname, dt)
                dist.reduce(x, dst=root, op=op_of(dist, opname), group=pg)
                if me == root:
                    assert_equal(x, expect, f"reduce {opname} {dt}")
                else:
                    np.testing.assert_array_equal(x, before)


def check_reduce_scatter(dist, pg, dtypes, ops=REDUCE_OPS, rows=9, in_place=True):
    """Out of place, strided output and (``in_place``: MPI's path refuses it) an output
    that is this rank's block of the input."""
    members = dist.get_process_group_ranks(pg)
    n, me, gr = len(members), dist.get_rank(), pg.rank()
    for opname in ops:
        for dt in dtypes:
            if not supported(dt, opname):
                continue
            x = make(me, (n * rows, 3), dt, opname)
            full = reduce_ref([make(r, (n * rows, 3), dt, opname) for r in members], opname, dt)
            want = full[rows * gr:rows * (gr + 1)]
            out = np.zeros((rows, 3), dt)
            finish(dist.reduce_scatter_tensor(out, x, op=op_of(dist, opname), group=pg,
                                              async_op=True), True)
            assert_equal(out, want, f"reduce_scatter_tensor {opname} {dt}")
            base = np.zeros((rows, 6), dt)  # strided output
            dist.reduce_scatter_tensor(base[:, ::2], x.reshape(-1), op=op_of(dist, opname),
                                       group=pg)
            assert_equal(base[:, ::2], want, f"reduce_scatter_tensor {opname} {dt} strided")
            assert not base[:, 1::2].any()
            if not in_place:
                continue
            y = x.copy()
            mine = y[rows * gr:rows * (gr + 1)]
            dist.reduce_scatter_tensor(mine, y, op=op_of(dist, opname), group=pg)
            assert_equal(mine, want, f"reduce_scatter_tensor {opname} {dt} in place")


def check_movement(dist, pg, dtypes, rows=9, in_place=True):
    """broadcast (every root), all_gather_into_tensor (out of place, in place unless
    ``in_place`` is false: MPI's path refuses it, strided output), all_gather with a
    different size per rank."""
    members = dist.get_process_group_ranks(pg)
    n, me, gr = len(members), dist.get_rank(), pg.rank()
    for dt in dtypes:
        for root in members:
            x = make(me, (rows, 5), dt)
            dist.broadcast(x, src=root, group=pg)
            np.testing.assert_array_equal(x, make(root, (rows, 5), dt))
            base = np.zeros((rows, 10), dt)
            view = base[:, ::2]
            view[...] = make(me, (rows, 5), dt)
            finish(dist.broadcast(view, src=root, group=pg, async_op=True), True)
            np.testing.assert_array_equal(view, make(root, (rows, 5), dt))
            assert not base[:, 1::2].any()
        want = np.concatenate([make(r, (rows, 3), dt) for r in members])
        out = np.zeros((n * rows, 3), dt)
        dist.all_gather_into_tensor(out, make(me, (rows, 3), dt), group=pg)
        np.testing.assert_array_equal(out, want)
        if in_place:
            out = np.zeros((n * rows, 3), dt)
            out[rows * gr:rows * (gr + 1)] = make(me, (rows, 3), dt)
            finish(dist.all_gather_into_tensor(out, out[rows * gr:rows * (gr + 1)], group=pg,
                                               async_op=True), True)
            np.testing.assert_array_equal(out, want)
        base = np.zeros((n * rows, 6), dt)
        dist.all_gather_into_tensor(base[:, ::2], make(me, (rows, 3), dt)[:, :], group=pg)
        np.testing.assert_array_equal(base[:, ::2], want)
        outs = [np.zeros(rows * (i + 1), dt) for i in range(n)]
        outs[-1] = np.zeros((2 * rows * n,), dt)[::2]  # a strided output among them
        dist.all_gather(outs, make(me, (rows * (gr + 1),), dt), group=pg)
        for i, r in enumerate(members):
            np.testing.assert_array_equal(outs[i], make(r, (rows * (i + 1),), dt))


def check_all_reduce_coalesced(dist, pg, dtypes, ops=REDUCE_OPS):
    """all_reduce_coalesced of one dtype at a time (the engine's fused path: the arrays
    gathered into its window and reduced back into them, in C for plain arrays, in numpy
    where the list holds a view, on one rank or on all): numpy's result on every rank;
    then, for float32 and float64 SUM (the lists the engine fuses; AVG, PREMUL_SUM and
    16-bit floats are MPI's), the bits of the rank-order sum on every rank, either way."""
    members = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    shapes = [(13,), (4, 5), (), (0,), (7, 3)]
    for opname in ops:
        for dt in dtypes:
            if not supported(dt, opname):
                continue
            for views in ("none", "first rank", "all"):
                arrays = [make(me, s, dt, opname, salt=k) for k, s in enumerate(shapes)]
                if views == "all" or (views == "first rank" and me == members[0]):
                    wide = np.zeros((7, 6), dt)
                    wide[:, ::2] = arrays[4]
                    arrays[4] = wide[:, ::2]
                expect = [reduce_ref([make(r, s, dt, opname, salt=k) for r in members], opname, dt)
                          for k, s in enumerate(shapes)]
                dist.all_reduce_coalesced(arrays, op=op_of(dist, opname), group=pg)
                for got, want in zip(arrays, expect, strict=True):
                    assert_equal(np.asarray(got), want,
                                 f"all_reduce_coalesced {opname} {dt} views: {views}")
    for dt in (d for d in dtypes if d.kind in "iu"):   # sums wrap around, as numpy's do
        top = np.iinfo(dt).max
        arrays = [np.full(5, top, dt), np.full((2, 3), top - me, dt)]
        dist.all_reduce_coalesced(arrays, group=pg)
        want = [np.full(5, top, dt), np.full((2, 3), top, dt)]
        for r in members[1:]:
            want = [want[0] + np.asarray(top, dt), want[1] + np.asarray(top - r, dt)]
        want[1] -= np.asarray(members[0], dt)   # members[0]'s term was top - members[0]
        for got, w in zip(arrays, want, strict=True):
            np.testing.assert_array_equal(got, w, err_msg=f"all_reduce_coalesced wraps {dt}")
    for dt in (d for d in dtypes if d.kind == "f" and d.itemsize >= 4):
        for opname in ("SUM",):
            for views in (False, True):
                x = _rank_input(me, 3001, dt)
                arrays = [x[:1000].copy(), x[1000:].copy()]
                if views:
                    wide = np.zeros((2001, 2), dt)
                    wide[:, 0] = arrays[1]
                    arrays[1] = wide[:, 0]
                dist.all_reduce_coalesced(arrays, op=op_of(dist, opname), group=pg)
                got = np.concatenate(arrays)
                want = _ordered_sum([_rank_input(r, 3001, dt) for r in members],
                                    [list(range(len(members)))], opname, dt)
                np.testing.assert_array_equal(
                    got.view(np.uint8), want.view(np.uint8),
                    err_msg=f"all_reduce_coalesced {opname} {dt} views={views}: not the "
                            "rank-order sum")


def _rank_input(rank: int, count: int, dt) -> np.ndarray:
    rng = np.random.default_rng(1234 + rank)
    return (rng.standard_normal(count) * 10 ** rng.uniform(-3, 3, count)).astype(dt)


def _ordered_sum(inputs: list, nodes: list, opname: str, dt) -> np.ndarray:
    """The sum of each node's inputs in local-rank order, then of the nodes' sums in node
    order, accumulated as the engine does (in float32 for 16-bit floats)."""
    wide = np.float32 if family(np.dtype(dt)) == "half" else dt
    scale = PREMUL_FACTOR if opname == "PREMUL_SUM" else None
    total = None
    for node in nodes:
        acc = None
        for i in node:
            x = inputs[i].astype(wide)
            if scale is not None:
                x = x * np.asarray(scale, wide)
            acc = x if acc is None else acc + x
        total = acc if total is None else total + acc
    if opname == "AVG":
        total = total / np.asarray(len(inputs), wide)
    return total.astype(dt)


def check_same_bits(dist, pg, dtypes, count=3001, ordered=True):
    """Random floats of every magnitude: every rank gets the same bits and, if
    ``ordered`` (True: one node; else a list of nodes' lists of group ranks), the bits of
    the sum taken in rank order within each node, then in node order."""
    members = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    for dt in dtypes:
        for opname in ("SUM", "AVG", "PREMUL_SUM"):
            x = _rank_input(me, count, dt)
            dist.all_reduce(x, op=op_of(dist, opname), group=pg)
            mine = x.view(np.uint8).tobytes()
            everyone = pg.comm.allgather(mine)
            assert all(b == mine for b in everyone), f"{opname} {dt}: ranks got different bits"
            if ordered:
                nodes = [list(range(len(members)))] if ordered is True else ordered
                want = _ordered_sum([_rank_input(r, count, dt) for r in members], nodes,
                                    opname, dt)
                np.testing.assert_array_equal(x.view(np.uint8), want.view(np.uint8),
                                              err_msg=f"{opname} {dt}: not the rank-order sum")
