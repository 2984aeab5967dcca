"""The shared-memory engine (spmd/backends/shm/engine.py) on one node: one-shot and two-shot
all_reduce, reduce, reduce_scatter_tensor, broadcast and the all-gathers, through tiny
slots so that every array takes several chunks around the ring; bit-identical floats;
ordering of asynchronous ops; deadlines; MPI progress; fallback to MPI.

These tests force the engine on their own groups, so they run in the SPMD_SHM=0 run of
the suite as well as in the forced one.
"""

from datetime import timedelta

import numpy as np
import pytest
from conftest import _initialised, all_dtypes
from mpi4py import MPI
from programs.shm_checks import (
    check_all_reduce,
    check_all_reduce_coalesced,
    check_movement,
    check_reduce,
    check_reduce_scatter,
    check_same_bits,
    engine_group,
    engine_of,
)

pytestmark = pytest.mark.mpi
DTYPES = all_dtypes()
FLOATS = [dt for dt in DTYPES if dt.kind == "f" or dt.name == "bfloat16"]

# slot_bytes, one_shot_max: tiny slots, so (13, 17) arrays take up to 28 chunks
ALGOS = {"one-shot": (1 << 16, 1 << 16), "two-shot": (128, 0)}


def _halves(n):
    return [list(range(0, n, 2))] + ([list(range(1, n, 2))] if n > 1 else [])


@pytest.fixture(scope="module", params=sorted(ALGOS))
def engine_groups(request):
    """WORLD-sized and parity groups whose engines use one algorithm at every size."""
    dist = _initialised()
    slot, one_shot = ALGOS[request.param]
    n = dist.get_world_size()
    world = engine_group(dist, list(range(n)), slot_bytes=slot, one_shot_max=one_shot)
    parity = engine_group(dist, split=_halves(n), slot_bytes=slot, one_shot_max=one_shot)
    yield {"world": world, "parity": parity}
    if dist.is_initialized():
        dist.destroy_process_group(parity)
        dist.destroy_process_group(world)


@pytest.mark.parametrize("group_kind", ["world", "parity"])
def test_all_reduce(dist, engine_groups, group_kind):
    check_all_reduce(dist, engine_groups[group_kind], DTYPES)


@pytest.mark.parametrize("group_kind", ["world", "parity"])
def test_all_reduce_coalesced(dist, engine_groups, group_kind):
    check_all_reduce_coalesced(dist, engine_groups[group_kind], DTYPES)


@pytest.mark.parametrize("group_kind", ["world", "parity"])
def test_reduce(dist, engine_groups, group_kind):
    check_reduce(dist, engine_groups[group_kind], DTYPES)


@pytest.mark.parametrize("group_kind", ["world", "parity"])
def test_reduce_scatter_tensor(dist, engine_groups, group_kind):
    check_reduce_scatter(dist, engine_groups[group_kind], DTYPES)


@pytest.mark.parametrize("group_kind", ["world", "parity"])
def test_broadcast_and_all_gathers(dist, engine_groups, group_kind):
    check_movement(dist, engine_groups[group_kind], DTYPES)


@pytest.mark.parametrize("group_kind", ["world", "parity"])
def test_every_rank_gets_the_same_bits(dist, engine_groups, group_kind):
    check_same_bits(dist, engine_groups[group_kind], FLOATS)


def test_engine_really_ran(dist, engine_groups):
    """The checks above went through the engine: its window is set up and used."""
    pg = engine_groups["world"]
    dist.all_reduce(np.ones(100), group=pg)
    engine = engine_of(pg)
    assert engine._win is not None and engine._win.seq > 0
    assert engine.describe().startswith("force: ")


def test_async_ops_complete_in_any_wait_order(dist, engine_groups):
    """Many async ops on one engine (and MPI ops between them), waited newest first."""
    pg = engine_groups["world"]
    n = dist.get_world_size()
    xs = [np.full(300, float(k)) for k in range(6)]
    works = []
    for k, x in enumerate(xs):
        works.append(dist.all_reduce(x, group=pg, async_op=True))
        if k == 2:
            works.append(dist.all_reduce(np.ones(1), group=dist.GroupMember.WORLD,
                                         async_op=True))
    for w in reversed(works):
        w.wait()
    for k, x in enumerate(xs):
        np.testing.assert_array_equal(x, np.full(300, k * n))
    fut = dist.all_reduce(np.ones(3), group=pg, async_op=True).get_future()
    assert fut.wait()[0].tolist() == [n] * 3


def test_groups_waited_in_different_orders(dist):
    """Two engines with multi-chunk ops in flight; ranks wait for them in opposite
    orders: a rank waiting in one group keeps the other group's op moving."""
    n, me = dist.get_world_size(), dist.get_rank()
    a = engine_group(dist, list(range(n)), slot_bytes=128, one_shot_max=0)
    b = engine_group(dist, list(range(n)), slot_bytes=128, one_shot_max=0)
    x, y = np.full(500, 1.0 + me), np.full(500, 2.0 + me)
    wa = dist.all_reduce(x, group=a, async_op=True)
    wb = dist.all_reduce(y, group=b, async_op=True)
    for w in ((wa, wb) if me % 2 else (wb, wa)):
        w.wait(timeout=30)
    np.testing.assert_array_equal(x, np.full(500, n + n * (n - 1) / 2))
    np.testing.assert_array_equal(y, np.full(500, 2 * n + n * (n - 1) / 2))
    dist.destroy_process_group(b)
    dist.destroy_process_group(a)


def test_wait_deadline(dist):
    """A rank whose peers never join the op gets DistTimeoutError, not a hang."""
    n, me = dist.get_world_size(), dist.get_rank()
    if n < 2:
        pytest.skip("needs two ranks")
    pg = engine_group(dist, list(range(n)))
    dist.all_reduce(np.ones(8), group=pg)  # sets the window up (collective)
    if me == 0:
        work = dist.all_reduce(np.ones(8), group=pg, async_op=True)
        with pytest.raises(dist.DistTimeoutError, match="all_reduce"):
            work.wait(timeout=0.3)
        assert not work.is_completed()
    dist.barrier()
    dist.destroy_process_group(pg)


def test_engine_keeps_mpi_moving(dist):
    """Rank 0 starts a large isend, then an engine op; rank 1 first blocks in the receive.
    Where the MPI library moves the message only while the sender calls into MPI, rank 0
    must keep MPI progressing while it waits in the engine (MPICH 5 does not need it)."""
    n, me = dist.get_world_size(), dist.get_rank()
    if n < 2:
        pytest.skip("needs two ranks")
    pg = engine_group(dist, [0, 1], timeout=timedelta(seconds=30))
    if pg is None:
        return
    big = np.arange(4 << 20, dtype=np.float32)  # 16 MiB: too large to go eagerly
    x = np.ones(16)
    if me == 0:
        send = dist.isend(big, dst=1)
        dist.all_reduce(x, group=pg)
        send.wait()
    else:
        got = np.zeros_like(big)
        dist.recv(got, src=0)
        dist.all_reduce(x, group=pg)
        np.testing.assert_array_equal(got, big)
    np.testing.assert_array_equal(x, np.full(16, 2.0))
    dist.destroy_process_group(pg)


def test_auto_mode_leaves_small_messages_to_mpi(dist, monkeypatch):
    monkeypatch.setenv("SPMD_SHM", "auto")
    pg = dist.new_group(list(range(dist.get_world_size())))
    engine = engine_of(pg)
    if dist.get_world_size() == 1:
        assert engine is None  # nothing to share with
    else:
        dist.all_reduce(np.ones(4), group=pg)
        assert engine._win is None  # never set up: the op went to MPI
        assert engine.all_reduce_from > 32
    dist.destroy_process_group(pg)


def test_off_means_no_engine(dist, monkeypatch):
    monkeypatch.setenv("SPMD_SHM", "0")
    pg = dist.new_group(list(range(dist.get_world_size())))
    assert engine_of(pg) is None
    x = np.ones(1 << 16)
    dist.all_reduce(x, group=pg)
    assert x[0] == dist.get_world_size()
    dist.destroy_process_group(pg)


def test_falls_back_to_mpi_without_shared_windows(dist, monkeypatch):
    """Where Allocate_shared fails, results still come (from MPI) and the status says why."""
    from spmd.backends.shm import engine as shm
    from spmd.backends.shm import window as _shm_window

    def refuse(nbytes, node):
        raise MPI.Exception(MPI.ERR_UNSUPPORTED_OPERATION)

    monkeypatch.setattr(_shm_window, "_allocate", refuse)
    pg = engine_group(dist, list(range(dist.get_world_size())))
    x = np.arange(1000.0)
    dist.all_reduce(x, group=pg)
    np.testing.assert_array_equal(x, np.arange(1000.0) * dist.get_world_size())
    engine = engine_of(pg)
    assert engine._win is None
    said = shm.status(pg.engine_for("cpu"))
    assert "unavailable" in said and "MPI_Win_allocate_shared" in said
    out = np.zeros(1000 * dist.get_world_size())
    dist.all_gather_into_tensor(out, x, group=pg)
    np.testing.assert_array_equal(out, np.tile(x, dist.get_world_size()))
    dist.destroy_process_group(pg)
