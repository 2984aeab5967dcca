"""Python frames per blocking op on host arrays: the public function, then one call into
C (the compiled path's entry, ``spmd.backends.mpi.fastcall.direct``), which finds the
group's FastComm and runs the op.  Counted with ``sys.setprofile``, which sees every
Python frame and every call of a C function: unlike a time, the count holds on every
machine.  With the compiled path off (SPMD_FASTCALL=0, or not built) the counts do not
apply and the tests say so; the results are checked either way.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from _call_graph import calls_in

from spmd.backends.mpi import fastcall

pytestmark = pytest.mark.mpi


def _compiled_or_skip() -> None:
    if fastcall.compiled is None:
        pytest.skip(f"the compiled path is off ({fastcall.reason}): the counts are its")


def _shm_takes(dist, op: str, nbytes: int) -> bool:
    """Whether the group's shared-memory engine takes ``op`` at ``nbytes`` (its
    thresholds: SPMD_SHM=force puts them at 0); the compiled path is for sizes below."""
    shm = dist.GroupMember.WORLD.engines["cpu"].shm
    if shm is None:
        return False
    if op == "all_gather_into_tensor":
        return shm.gathers(nbytes)
    first = {"all_reduce": shm.all_reduce_from, "broadcast": shm.broadcast_from,
             "reduce": shm.reduce_from, "reduce_scatter_tensor": shm.reduce_scatter_from}
    return op in first and nbytes >= first[op]


def _ops(dist) -> dict[str, tuple[str, Callable[[], None], Callable[[], object],
                                    Callable[[], None]]]:
    """op -> (its file, what sets its inputs, a blocking call on small host arrays, a
    check of the result against numpy)."""
    n, r = dist.get_world_size(), dist.get_rank()
    x = np.empty(4, np.float64)
    out = np.empty(4 * n, np.float64)
    rows = np.empty(4 * n, np.float64)

    def fill(value):
        def start():
            x[...] = value
        return start

    def fill_rows():
        rows[...] = np.arange(4 * n) + 100 * r

    gathered = np.concatenate([np.full(4, k + 1.0) for k in range(n)])
    exchanged = np.concatenate([np.arange(4 * r, 4 * r + 4) + 100 * k for k in range(n)])

    def equal(got, want):
        return lambda: np.testing.assert_array_equal(got, want)

    return {
        "all_reduce": ("collectives", fill(r + 1.0), lambda: dist.all_reduce(x),
                       equal(x, np.full(4, n * (n + 1) / 2))),
        "broadcast": ("collectives", fill(r + 7.0), lambda: dist.broadcast(x, src=n - 1),
                      equal(x, np.full(4, n + 6.0))),
        "reduce": ("collectives", fill(r + 1.0), lambda: dist.reduce(x, dst=0),
                   equal(x, np.full(4, n * (n + 1) / 2 if r == 0 else r + 1.0))),
        "all_gather_into_tensor": ("collectives", fill(r + 1.0),
                                   lambda: dist.all_gather_into_tensor(out, x),
                                   equal(out, gathered)),
        "reduce_scatter_tensor": ("collectives", fill_rows,
                                  lambda: dist.reduce_scatter_tensor(x, rows),
                                  equal(x, np.arange(4 * r, 4 * r + 4) * n
                                        + 100 * n * (n - 1) / 2)),
        "all_to_all_single": ("collectives", fill_rows,
                              lambda: dist.all_to_all_single(out, rows),
                              equal(out, exchanged)),
        "barrier": ("collectives", lambda: None, lambda: dist.barrier(), lambda: None),
    }


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "reduce", "all_gather_into_tensor",
                                "reduce_scatter_tensor", "all_to_all_single", "barrier"])
def test_a_blocking_collective_is_one_frame_and_one_call_into_c(dist, op):
    where, prepare, call, check = _ops(dist)[op]
    prepare()
    call()   # the first call makes the group's engines
    check()
    prepare()
    frames, c_calls = calls_in(call)
    check()
    _compiled_or_skip()
    n = dist.get_world_size()
    nbytes = {"all_gather_into_tensor": 32 * n, "reduce_scatter_tensor": 32 * n}.get(op, 32)
    if _shm_takes(dist, op, nbytes):
        pytest.skip(f"the shared-memory engine takes {op} of {nbytes} B here (SPMD_SHM=force?): "
                    "the compiled path is for the sizes below its thresholds")
    assert frames == [f"api/{where}.py:{op}"], frames
    assert c_calls == [op], c_calls


def test_send_and_recv_are_one_frame_and_one_call_into_c(dist):
    n, r = dist.get_world_size(), dist.get_rank()
    if n == 1:
        pytest.skip("send and recv need a peer (world size 1)")
    x = np.full(5, r + 1.0)

    def exchange():
        if r == 0:
            dist.send(x, dst=1, tag=3)
        elif r == 1:
            assert dist.recv(x, src=0, tag=3) == 0

    exchange()
    frames, c_calls = calls_in(exchange)
    np.testing.assert_array_equal(x, np.full(5, 1.0 if r < 2 else r + 1.0))
    if r > 1:
        return
    _compiled_or_skip()
    op = "send" if r == 0 else "recv"
    assert frames == [f"api/p2p.py:{op}"], frames
    assert c_calls == [op], c_calls


def test_calls_the_entry_declines_take_the_python_path(dist, fresh):
    """An async call, a reduce op MPI does not apply itself (AVG), a timeout of the
    call's own, a non-contiguous view: the entry declines them and the op's Python path (which finds
    the group with ``resolve``) runs them, with the same results; a group destroyed
    since raises that path's error."""
    n, r = dist.get_world_size(), dist.get_rank()
    g, h = fresh(), fresh()
    dist.barrier(group=g)          # the group's host engine exists from here on
    x = np.full(4, r + 1.0)
    y = np.full(4, r + 1.0)
    wide = np.full((4, 2), r + 1.0)
    calls = {"async": lambda: dist.all_reduce(x, group=g, async_op=True).wait(),
             "avg": lambda: dist.all_reduce(y, op=dist.ReduceOp.AVG, group=g),
             "timeout": lambda: dist.barrier(group=g, timeout=30),
             "view": lambda: dist.all_reduce(wide[:, 0], group=g)}
    for name, call in calls.items():
        frames, _ = calls_in(call)
        assert "runtime/group.py:resolve" in frames, (name, frames)
    np.testing.assert_array_equal(x, np.full(4, n * (n + 1) / 2))
    np.testing.assert_array_equal(y, np.full(4, (n + 1) / 2))
    np.testing.assert_array_equal(wide[:, 0], np.full(4, n * (n + 1) / 2))
    np.testing.assert_array_equal(wide[:, 1], np.full(4, r + 1.0))
    dist.barrier(group=h)
    dist.destroy_process_group(h)
    with pytest.raises(RuntimeError, match="destroyed"):
        dist.all_reduce(x, group=h)


def test_a_root_given_as_a_group_rank_takes_the_compiled_path(dist, fresh):
    """broadcast, reduce, send and recv with group_src/group_dst (how torch's ops name
    roots) run on the compiled path too; a group rank out of range, or given beside a
    global one, is declined to the Python path, which says what is wrong."""
    n, r = dist.get_world_size(), dist.get_rank()
    g = fresh()
    dist.barrier(group=g)
    x = np.full(3, r + 1.0)
    frames, c_calls = calls_in(lambda: dist.broadcast(x, group=g, group_src=n - 1))
    np.testing.assert_array_equal(x, np.full(3, float(n)))
    y = np.full(3, r + 1.0)
    rframes, rc_calls = calls_in(lambda: dist.reduce(y, group=g, group_dst=0))
    if r == 0:
        np.testing.assert_array_equal(y, np.full(3, n * (n + 1) / 2))
    with pytest.raises(ValueError, match="group_src"):
        dist.broadcast(x, group=g, group_src=n)
    with pytest.raises(ValueError):
        dist.broadcast(x, src=0, group=g, group_src=0)
    _compiled_or_skip()
    if not _shm_takes(dist, "broadcast", x.nbytes):
        assert frames == ["api/collectives.py:broadcast"], frames
        assert c_calls == ["broadcast"], c_calls
    if not _shm_takes(dist, "reduce", y.nbytes):
        assert rframes == ["api/collectives.py:reduce"], rframes
        assert rc_calls == ["reduce"], rc_calls
