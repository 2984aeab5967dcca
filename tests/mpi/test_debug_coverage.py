"""Debug mode (DETAIL) covers the operations that run outside the engines: object
collectives and persistent plans compare their fingerprint across the group, so
mismatched calls end in CollectiveMismatchError on every rank (and the group stays in
step), while matched calls still give the numpy reference's results.  With debug mode
off they never reach the check.  MPMD links are covered in tests/mpi/test_mpmd.py."""

import re

import numpy as np
import pytest

from spmd.backends import checked

pytestmark = pytest.mark.mpi


@pytest.fixture
def fresh(dist):
    made = []

    def make(desc):
        g = dist.new_group(list(range(dist.get_world_size())), group_desc=desc)
        made.append(g)
        return g

    yield make
    for g in made:
        dist.destroy_process_group(g)


def _needs_peers(dist):
    if dist.get_world_size() < 2:
        pytest.skip("a mismatch needs two ranks")


def _expect_mismatch(dist, g, call, field, desc):
    """``call()`` raises CollectiveMismatchError naming ``field`` and the last rank on
    every rank; the group is still in step afterwards."""
    n = dist.get_world_size()
    with pytest.raises(dist.CollectiveMismatchError) as info:
        call()
    text = str(info.value)
    assert f"group {desc}" in text and "with different arguments" in text, text
    assert re.search(rf"arguments: {field}( \(global rank\))?: ", text), text
    assert f"rank {n - 1}" in text or f"ranks {n - 1}" in text, text
    assert "called from:" in text and "test_debug_coverage.py" in text, text
    x = np.ones(2)
    dist.all_reduce(x, group=g)
    assert (x == n).all()


# -- object collectives -------------------------------------------------------------

def _objects_cases(d, g, me, last):
    n = d.get_world_size()
    odd = me == last

    def bcast():
        d.broadcast_object_list([1, 2, 3] if odd else [1, 2], src=0, group=g)

    def gather():
        dst = 1 if odd else 0
        d.gather_object(me, [None] * n if me == dst else None, dst=dst, group=g)

    def scatter():
        src = 1 if odd else 0
        d.scatter_object_list([None], list(range(n)) if me == src else None, src=src, group=g)

    def object_vs_object():
        if odd:
            d.gather_object(me, [None] * n if me == 0 else None, dst=0, group=g)
        else:
            d.all_gather_object([None] * n, me, group=g)

    def object_vs_array():
        if odd:
            d.all_gather_object([None] * n, me, group=g)
        else:
            d.all_reduce(np.ones(3), group=g)

    return {"broadcast_object_list": (bcast, "length"), "gather_object": (gather, "root"),
            "scatter_object_list": (scatter, "root"), "object_vs_object": (object_vs_object, "op"),
            "object_vs_array": (object_vs_array, "op")}


@pytest.mark.parametrize("case", ["broadcast_object_list", "gather_object",
                                  "scatter_object_list", "object_vs_object", "object_vs_array"])
def test_object_collectives_mismatch_raises_everywhere(dist, fresh, detail, case):
    _needs_peers(dist)
    n, me = dist.get_world_size(), dist.get_rank()
    desc = f"dbgobj_{case}"
    g = fresh(desc)
    call, field = _objects_cases(dist, g, me, n - 1)[case]
    _expect_mismatch(dist, g, call, field, desc)


def test_object_collectives_matched_pass_in_debug_mode(dist, fresh, detail):
    n, me = dist.get_world_size(), dist.get_rank()
    g = fresh("dbgobj_ok")
    got = [None] * n
    dist.all_gather_object(got, {"rank": me}, group=g)
    assert got == [{"rank": r} for r in range(n)]
    root = n - 1
    into = [None] * n if me == root else None
    dist.gather_object(me * 10, into, dst=root, group=g)
    if me == root:
        assert into == [r * 10 for r in range(n)]
    lst = ["a", me] if me == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0, group=g)
    assert lst == ["a", 0]
    out = [None]
    dist.scatter_object_list(out, [("s", r) for r in range(n)] if me == 0 else None, src=0,
                             group=g)
    assert out == [("s", me)]
    if n > 1:  # point to point: not fingerprinted, still works
        if me == 0:
            dist.send_object_list([1, "x"], dst=1, group=g)
        elif me == 1:
            box = [None, None]
            assert dist.recv_object_list(box, src=0, group=g) == 0 and box == [1, "x"]


def test_checks_run_only_in_detail(dist, fresh, monkeypatch):
    """Debug mode off: object collectives and plans never reach the check; DETAIL: each
    compares once (a plan when made and at every start)."""
    calls = []
    real = checked.check_call
    monkeypatch.setattr(checked, "check_call",
                        lambda pg, op, *a: (calls.append(op), real(pg, op, *a)))
    n = dist.get_world_size()
    before = dist.get_debug_level()
    expected = {"OFF": [], "DETAIL": ["all_gather_object", "broadcast_object_list"]
                + ["persistent.all_reduce"] * 3}
    for level, expect in expected.items():
        dist.set_debug_level(level)
        try:
            g = fresh(f"dbgcount_{level}")
            calls.clear()
            dist.all_gather_object([None] * n, 1, group=g)
            dist.broadcast_object_list([1], src=0, group=g)
            x = np.ones(3)
            with dist.persistent.all_reduce(x, group=g) as plan:
                plan.start().wait()
                plan.start().wait()
            assert (x == n * n).all()
        finally:
            dist.set_debug_level(before)
        # a fallback plan's start also runs the checked engine's all_reduce check
        assert [c for c in calls if c != "all_reduce"] == expect, (level, calls)


# -- persistent plans ---------------------------------------------------------------

def test_persistent_plan_made_differently_raises_everywhere(dist, fresh, detail):
    _needs_peers(dist)
    n, me = dist.get_world_size(), dist.get_rank()
    g = fresh("dbgplan_make")
    x = np.ones(4 if me == n - 1 else 3)
    _expect_mismatch(dist, g, lambda: dist.persistent.all_reduce(x, group=g), "shape",
                     "dbgplan_make")
    op = dist.ReduceOp.MAX if me == n - 1 else dist.ReduceOp.SUM
    _expect_mismatch(dist, g, lambda: dist.persistent.all_reduce(np.ones(3), op=op, group=g),
                     "reduce_op", "dbgplan_make")
    src = 1 if me == n - 1 else 0
    _expect_mismatch(dist, g, lambda: dist.persistent.broadcast(np.ones(3), src=src, group=g),
                     "root", "dbgplan_make")
    fused = [np.ones(2), np.ones((2, 3) if me == n - 1 else (3, 2))]
    _expect_mismatch(dist, g, lambda: dist.persistent.all_reduce_coalesced(fused, group=g),
                     "shapes", "dbgplan_make")


def test_persistent_plans_started_out_of_order_raise_everywhere(dist, fresh, detail):
    _needs_peers(dist)
    n, me = dist.get_world_size(), dist.get_rank()
    g = fresh("dbgplan_start")
    a, b = np.ones(3), np.ones(3)
    plans = [dist.persistent.all_reduce(a, group=g), dist.persistent.all_reduce(b, group=g)]
    first = plans[1] if me == n - 1 else plans[0]
    _expect_mismatch(dist, g, first.start, "plan", "dbgplan_start")
    # nothing was started: the plans still run, in the same order everywhere
    for p in plans:
        p.start().wait()
        p.free()
    assert (a == n).all() and (b == n).all()


def test_persistent_plans_matched_pass_in_debug_mode(dist, fresh, detail):
    n, me = dist.get_world_size(), dist.get_rank()
    g = fresh("dbgplan_ok")
    x = np.arange(6.0) + me
    y = np.full(4, float(me))
    out = np.empty(2 * n)
    mine = np.full(2, float(me))
    z = np.full(3, float(me + 1))
    rows = np.arange(2.0 * n) + 10 * me  # rank me's row j goes to rank j // 2
    got = np.empty(2 * n)
    red = np.empty(2)
    with dist.persistent.all_reduce(x, group=g) as p1, \
            dist.persistent.broadcast(y, src=n - 1, group=g) as p2, \
            dist.persistent.all_gather_into_tensor(out, mine, group=g) as p3, \
            dist.persistent.barrier(group=g) as p4, \
            dist.persistent.reduce(z, dst=0, group=g) as p5, \
            dist.persistent.reduce_scatter_tensor(red, rows, group=g) as p6, \
            dist.persistent.all_to_all_single(got, rows, group=g) as p7:
        for _ in range(2):
            x[:] = np.arange(6.0) + me
            y[:] = me
            z[:] = me + 1
            for p in (p1, p2, p3, p4, p5, p6, p7):
                p.start().wait()
            np.testing.assert_array_equal(x, n * np.arange(6.0) + n * (n - 1) / 2)
            np.testing.assert_array_equal(y, np.full(4, float(n - 1)))
            np.testing.assert_array_equal(out, np.repeat(np.arange(n, dtype=float), 2))
            if me == 0:
                np.testing.assert_array_equal(z, np.full(3, n * (n + 1) / 2))
            np.testing.assert_array_equal(
                red, sum(np.arange(2.0 * n)[2 * me:2 * me + 2] + 10 * r for r in range(n)))
            np.testing.assert_array_equal(
                got, np.concatenate([np.arange(2.0 * me, 2.0 * me + 2) + 10 * r for r in range(n)]))
