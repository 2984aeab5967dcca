"""The torch backend's call path: a call torch waits for at once runs as spmd's blocking
call (the compiled path, where it takes it) and hands torch no Work; a call that may be
waited for later (async_op=True, DDP's C++ reducer, a timeout of the op's own, a
coalescing block) gets its SpmdWork.  The same results either way, on every rank."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
from _call_graph import calls_in
from test_torch_backend import td  # noqa: F401 - the fixture: torch.distributed on spmd

from spmd.backends.mpi import fastcall

torch = pytest.importorskip("torch", reason="torch is not installed")
tdist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.mpi

from torch._C._distributed_c10d import (  # noqa: E402 - after the skip without torch
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceScatterOptions,
)


def _pg():
    return tdist.distributed_c10d._get_default_group()


def _calls(me: int, n: int):
    """(op, options class, call(pg, opts) -> what the backend returned, check())."""
    x = torch.full((3,), float(me + 1))
    yield "allreduce", AllreduceOptions, lambda pg, o: pg.allreduce([x], o), \
        lambda: torch.equal(x, torch.full((3,), float(n * (n + 1) // 2)))
    b = torch.full((2,), float(me))
    yield "broadcast", BroadcastOptions, lambda pg, o: pg.broadcast([b], o), \
        lambda: torch.equal(b, torch.zeros(2))
    big, small = torch.zeros(2 * n), torch.full((2,), float(me))
    yield "all_gather_single", AllgatherOptions, \
        lambda pg, o: pg.all_gather_single(big, small, o), \
        lambda: torch.equal(big, torch.arange(n).repeat_interleave(2).float())
    src, out = torch.arange(2 * n, dtype=torch.float32), torch.zeros(2)
    yield "reduce_scatter_single", ReduceScatterOptions, \
        lambda pg, o: pg.reduce_scatter_single(out, src, o), \
        lambda: torch.equal(out, n * torch.arange(2 * me, 2 * me + 2, dtype=torch.float32))
    a2a_in, a2a_out = torch.full((n,), float(me)), torch.zeros(n)
    yield "all_to_all_single", AllToAllOptions, \
        lambda pg, o: pg.all_to_all_single(a2a_out, a2a_in, [], [], o), \
        lambda: torch.equal(a2a_out, torch.arange(n, dtype=torch.float32))
    yield "barrier", BarrierOptions, lambda pg, o: pg.barrier(o), lambda: True


@pytest.mark.parametrize("waited", [True, False], ids=["blocking", "async"])
def test_a_blocking_call_hands_torch_no_work(td, waited):  # noqa: F811
    me, n = td.get_rank(), td.get_world_size()
    pg = _pg()
    for op, options, call, check in _calls(me, n):
        opts = options()
        opts.asyncOp = not waited
        got = call(pg, opts)
        if waited:
            assert got is None, (op, got)
        else:
            assert isinstance(got, tdist.Work), (op, got)
            got.wait()
        assert check(), op


def test_torch_blocking_all_reduce_takes_the_compiled_path(td):  # noqa: F811
    """``dist.all_reduce`` of a small tensor is one call of the group's compiled path
    (none where the path is off: the same result from the Python one)."""
    import spmd

    me, n = td.get_rank(), td.get_world_size()
    x = torch.full((4,), float(me))
    td.all_reduce(x)   # the group's host engine exists from here on
    fast = spmd.GroupMember.WORLD.engines["cpu"].fast
    assert (fast is None) == (fastcall.compiled is None)
    before = 0 if fast is None else fast.taken
    for k in range(5):
        x.fill_(float(me + k))
        td.all_reduce(x)
        assert torch.equal(x, torch.full((4,), float(sum(range(n)) + n * k)))
    b = torch.full((2,), float(me))
    td.broadcast(b, src=0)
    assert torch.equal(b, torch.zeros(2))
    td.barrier()
    assert (0 if fast is None else fast.taken - before) == (0 if fast is None else 7)


def test_timeouts_coalescing_and_async_keep_their_work(td):  # noqa: F811
    """A timeout of the op's own is waited for under that timeout (by its Work); a
    coalescing block collects Works; async_op=True returns one."""
    me, n = td.get_rank(), td.get_world_size()
    pg = _pg()
    opts = BarrierOptions()
    opts.asyncOp = False
    opts.timeout = timedelta(seconds=30)
    w = pg.barrier(opts)
    assert isinstance(w, tdist.Work)
    w.wait()
    pg.start_coalescing()
    try:
        xs = [torch.full((2,), float(me + k)) for k in range(3)]
        for x in xs:
            opts = AllreduceOptions()
            opts.asyncOp = False
            assert isinstance(pg.allreduce([x], opts), tdist.Work)
    finally:
        work = pg.end_coalescing()
    work.wait()
    for k, x in enumerate(xs):
        assert torch.equal(x, torch.full((2,), float(sum(range(n)) + n * k)))
    y = torch.full((2,), float(me))
    w = td.all_reduce(y, async_op=True)
    assert w is not None and w.wait()
    assert torch.equal(y, torch.full((2,), float(sum(range(n)))))
    np.testing.assert_array_equal(y.numpy(), np.full(2, float(sum(range(n)))))


def test_torch_hot_ops_take_at_most_three_spmd_frames(td):  # noqa: F811
    """torch's blocking all_reduce, broadcast, all_gather_into_tensor,
    reduce_scatter_tensor and barrier on small CPU tensors seen before: at most three
    of spmd's Python frames (the error translation, the backend's method, the kept
    views' lookup) and one call of the compiled path's entry; the results as numpy
    computes them."""
    if fastcall.compiled is None:
        pytest.skip(f"the compiled path is off ({fastcall.reason}): the counts are its")
    import spmd

    me, n = td.get_rank(), td.get_world_size()
    shm = spmd.GroupMember.WORLD.engines["cpu"].shm if "cpu" in spmd.GroupMember.WORLD.engines \
        else None
    x = torch.zeros(4)
    b = torch.zeros(3, dtype=torch.int64)
    small, big = torch.zeros(2), torch.zeros(2 * n)
    src, out = torch.zeros(2 * n), torch.zeros(2)
    ops = {
        "all_reduce": (lambda: x.copy_(torch.arange(4.0) + me),
                       lambda: td.all_reduce(x),
                       lambda: np.testing.assert_array_equal(
                           x.numpy(), sum(np.arange(4.0) + r for r in range(n)))),
        "broadcast": (lambda: b.fill_(7 if me == n - 1 else -1),
                      lambda: td.broadcast(b, src=n - 1),
                      lambda: np.testing.assert_array_equal(b.numpy(), np.full(3, 7))),
        "all_gather_into_tensor": (
            lambda: small.copy_(torch.tensor([me, 10.0 * me])),
            lambda: td.all_gather_into_tensor(big, small),
            lambda: np.testing.assert_array_equal(
                big.numpy(), np.array([[r, 10.0 * r] for r in range(n)]).ravel())),
        "reduce_scatter_tensor": (
            lambda: src.copy_(torch.arange(2.0 * n) * (me + 1)),
            lambda: td.reduce_scatter_tensor(out, src),
            lambda: np.testing.assert_array_equal(
                out.numpy(), np.arange(2.0 * n)[2 * me:2 * me + 2] * n * (n + 1) / 2)),
        "barrier": (lambda: None, lambda: td.barrier(), lambda: None),
    }
    for op, (fill, call, check) in ops.items():
        fill()
        call()        # the views are made and kept here
        check()
        fill()
        frames, c_calls = calls_in(call)
        check()
        takes_shm = shm is not None and op != "barrier" and (
            shm.gathers(8 * n * 2) if op == "all_gather_into_tensor" else
            4 * 8 >= getattr(shm, {"all_reduce": "all_reduce_from", "broadcast": "broadcast_from",
                                   "reduce_scatter_tensor": "reduce_scatter_from"}[op]))
        if takes_shm:
            continue   # SPMD_SHM=force: the shared-memory engine takes it on its own path
        assert len(frames) <= 3, (op, frames)
        assert c_calls.count(op) == 1, (op, c_calls)
