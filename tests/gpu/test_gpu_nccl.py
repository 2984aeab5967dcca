"""The NCCL backend on a real GPU.  NCCL refuses two ranks of one communicator on the
same GPU, so on a one-GPU machine it runs in groups of size 1 (at any world size), as
WORLD at world size 1, and with several ranks when each sets its own NCCL_HOSTID
(tests/gpu/run.sh; the collective suite runs on NCCL then too).  That exercises lazy and
eager creation, the unique-id bootstrap (over MPI and through a store), commSplit, the
communication stream and its events, Work semantics, the dtype/op tables, and the
refusal of two ranks on one GPU.  Skips (with the reason) without CuPy, NCCL or a GPU."""

import numpy as np
import pytest
from _gpu_helpers import (
    cupy_dtypes,
    nccl_ranks_skip_reason,
    nccl_skip_reason,
    on_device_double,
    to_device,
    to_host,
)
from conftest import TEST_TIMEOUT, _initialised, all_dtypes
from refs import PREMUL_FACTOR, make

pytestmark = pytest.mark.mpi
if nccl_skip_reason() is not None:
    pytest.skip(nccl_skip_reason(), allow_module_level=True)

NCCL_DTYPES = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
               "float64", "bfloat16", "complex64", "complex128", "bool"]


def _dtypes():
    return [dt for dt in cupy_dtypes(all_dtypes()) if dt.name in NCCL_DTYPES]


class _SoloGroup:
    """This rank's own NCCL group of size 1, made again when a test re-initialised spmd
    (which destroys every group) since it was made."""

    def __init__(self):
        self.pg = None

    def get(self):
        dist = _initialised()
        if self.pg is None or self.pg.context.comm is None:  # never made, or destroyed since
            self.pg, _ = dist.new_subgroups(group_size=1, backend="cpu:mpi,cuda:nccl",
                                            group_desc="solo")
        return self.pg


@pytest.fixture(scope="module")
def _solo_group():
    holder = _SoloGroup()
    yield holder
    if holder.pg is not None and holder.pg.context.comm is not None:
        _initialised().destroy_process_group(holder.pg)


@pytest.fixture
def solo(_solo_group):
    """cupy, spmd and this rank's own NCCL group of size 1 (alive in every test)."""
    from spmd.core import cuda as _gpu

    return _gpu.cupy_or_none(), _initialised(), _solo_group.get()


def test_lazy_creation_and_unique_id(solo):
    cp, dist, pg = solo
    backend = pg.engine_for("cuda")
    assert type(backend).__name__ == "NCCLEngine" and backend.communicator.nccl_comm is None
    x = cp.arange(4, dtype=cp.float32)
    dist.all_reduce(x, group=pg)
    assert backend.communicator.nccl_comm is not None and backend.communicator.created_by == "unique id"
    assert backend.communicator.nccl_comm.size() == 1 and backend.communicator.nccl_comm.rank_id() == 0
    np.testing.assert_array_equal(to_host(x), np.arange(4, dtype=np.float32))


def test_reductions_in_a_group_of_one(solo):
    cp, dist, pg = solo
    for dt in _dtypes():
        for opname in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM", "BAND", "BXOR"):
            host = make(0, (3, 5), dt, opname)
            x = to_device(cp, host, "strided")
            op = (dist.make_premul_sum(PREMUL_FACTOR) if opname == "PREMUL_SUM"
                  else getattr(dist.ReduceOp, opname))
            from spmd.backends.nccl.plans import plan_for

            if type(plan_for(dt, opname)) is str:
                with pytest.raises(TypeError, match="all_reduce: "):
                    dist.all_reduce(x, op=op, group=pg)
                continue
            if opname == "PREMUL_SUM" and dt.name in ("bfloat16",):
                continue  # scaling bfloat16 needs CuPy arithmetic on it
            dist.all_reduce(x, op=op, group=pg)
            expect = host * PREMUL_FACTOR if opname == "PREMUL_SUM" else host
            got = to_host(x)
            if dt.name == "bfloat16":
                got, expect = got.astype(np.float32), expect.astype(np.float32)
            np.testing.assert_allclose(got, expect, rtol=1e-2 if dt.itemsize <= 2 else 1e-6,
                                       err_msg=f"{opname} {dt}")
    with pytest.raises(TypeError, match="NCCL has no int16 type"):
        dist.all_reduce(cp.zeros(2, cp.int16), group=pg)
    with pytest.raises(TypeError, match="pairs of reals"):
        dist.all_reduce(cp.zeros(2, cp.complex64), op=dist.ReduceOp.MAX, group=pg)


def test_every_op_in_a_group_of_one(solo):
    cp, dist, pg = solo
    me = dist.get_rank()
    for dt in _dtypes() + [np.dtype(np.int16)]:
        a = to_device(cp, make(me, (2, 3), dt))
        x = a.copy()
        dist.broadcast(x, group_src=0, group=pg)
        np.testing.assert_array_equal(to_host(x), to_host(a))
        out = cp.zeros((1, 2, 3), dt)
        dist.all_gather_into_tensor(out, a, group=pg)
        np.testing.assert_array_equal(to_host(out)[0], to_host(a))
        outs = [cp.zeros((2, 6), dt)[:, ::2]]
        dist.all_gather(outs, a, group=pg)
        np.testing.assert_array_equal(to_host(outs[0]), to_host(a))
        g = [cp.zeros((2, 3), dt)]
        dist.gather(a, g, group_dst=0, group=pg)
        np.testing.assert_array_equal(to_host(g[0]), to_host(a))
        s = cp.zeros((2, 3), dt)
        dist.scatter(s, [a], group_src=0, group=pg)
        np.testing.assert_array_equal(to_host(s), to_host(a))
        o = [cp.zeros((2, 3), dt)]
        dist.all_to_all(o, [a], group=pg)
        np.testing.assert_array_equal(to_host(o[0]), to_host(a))
        single = cp.zeros((2, 3), dt)
        dist.all_to_all_single(single, a, [2], [2], group=pg)
        np.testing.assert_array_equal(to_host(single), to_host(a))
        lists = [[cp.zeros((2, 3), dt), cp.zeros((1,), dt)]]
        dist.all_gather_coalesced(lists, [a, a[0, :1]], group=pg)
        np.testing.assert_array_equal(to_host(lists[0][1]), to_host(a)[0, :1])
        if dt.name in ("int16", "bool"):
            continue
        r = a.copy()
        dist.reduce(r, group_dst=0, group=pg)
        np.testing.assert_array_equal(to_host(r), to_host(a))
        rs = cp.zeros((2, 3), dt)
        dist.reduce_scatter_tensor(rs, a, group=pg)
        np.testing.assert_array_equal(to_host(rs), to_host(a))
        rs2 = cp.zeros((2, 3), dt)
        dist.reduce_scatter(rs2, [a], group=pg)
        np.testing.assert_array_equal(to_host(rs2), to_host(a))
        c1, c2 = a.copy(), a[0].copy()
        dist.all_reduce_coalesced([c1, c2], group=pg)
        np.testing.assert_array_equal(to_host(c2), to_host(a)[0])
    dist.barrier(group=pg, device_ids=[0])


def test_stream_and_work_semantics(solo):
    cp, dist, pg = solo
    side = cp.cuda.Stream(non_blocking=True)
    with side:
        x = cp.ones(1 << 24, cp.float32)  # 64 MiB, produced on the side stream
        x *= 3
        work = dist.all_reduce(x, op=dist.ReduceOp.AVG, group=pg, async_op=True)
        assert work.wait() is True  # the side stream now waits for the operation
        y = x + 1                  # ordered after the all_reduce on the side stream
    side.synchronize()
    assert float(y[0]) == 4.0 and float(y[-1]) == 4.0
    work.synchronize()
    assert work.is_completed() and work.is_success()
    fut = dist.all_reduce(x, group=pg, async_op=True).get_future()
    assert fut.wait()[0] is x
    many = [dist.all_reduce(cp.ones(8, cp.float32), group=pg, async_op=True) for _ in range(50)]
    many[-1].synchronize()
    backend = pg.engine_for("cuda")
    backend.communicator.reap()
    assert all(w.is_completed() for w in many) and len(backend.communicator.inflight) <= 1


def test_nccl_only_group_and_store_bootstrap():
    from spmd.core import cuda as _gpu
    from spmd.store import HashStore

    dist = _initialised()
    cp = _gpu.cupy_or_none()
    if dist.get_world_size() != 1:
        pg, _ = dist.new_subgroups(group_size=1, backend="nccl")
        x = cp.full(3, 2.0)
        dist.all_reduce(x, group=pg)
        dist.barrier(group=pg)  # a group with only NCCL: the barrier is NCCL's
        with pytest.raises(RuntimeError, match="no backend handles cpu arrays"):
            dist.all_reduce(np.ones(1), group=pg)
        dist.destroy_process_group(pg)
        pytest.skip("WORLD on NCCL needs one GPU per rank; checked groups of one instead")
    store = HashStore()
    dist.destroy_process_group()
    try:
        dist.init_process_group(backend="cpu:mpi,cuda:nccl", store=store, timeout=TEST_TIMEOUT)
        x = cp.full(3, 2.0)
        dist.all_reduce(x)
        assert float(x[0]) == 2.0
        assert dist.GroupMember.WORLD.engines["cuda"].communicator.created_by == "unique id"
        assert store.num_keys() == 0  # at size 1 nothing is exchanged, nothing is left
    finally:
        dist.destroy_process_group()
        dist.init_process_group(timeout=TEST_TIMEOUT)


def test_eager_init_and_comm_split():
    from spmd.core import cuda as _gpu

    dist = _initialised()
    if dist.get_world_size() != 1:
        pytest.skip("WORLD on NCCL needs one GPU per rank")
    cp = _gpu.cupy_or_none()
    dist.destroy_process_group()
    try:
        dist.init_process_group(backend="cpu:mpi,cuda:nccl", device_id=cp.cuda.runtime.getDevice(),
                                timeout=TEST_TIMEOUT)
        world_nccl = dist.GroupMember.WORLD.engines["cuda"]
        assert world_nccl.communicator.nccl_comm is not None and world_nccl.communicator.created_by == "unique id"
        sub, _ = dist.new_subgroups(group_size=1)
        x = cp.ones(2)
        dist.all_reduce(x, group=sub)
        expected = "commSplit" if world_nccl.can_split() else "unique id"
        assert sub.engines["cuda"].communicator.created_by == expected
    finally:
        dist.destroy_process_group()
        dist.init_process_group(timeout=TEST_TIMEOUT)


def test_mixed_dtypes_all_gather_coalesced(solo):
    """Pieces of mixed dtypes sit at odd byte offsets in the gathered buffer; unpacking
    them must not read misaligned typed views (a fatal CUDA error)."""
    cp, dist, pg = solo
    ins = [cp.arange(3, dtype=cp.int8), cp.arange(2, dtype=cp.float64) + 0.5,
           (cp.arange(4, dtype=cp.complex64) * (1 + 2j))[::2], cp.arange(3, dtype=cp.int16)]
    outs = [[cp.zeros(3, cp.int8), cp.zeros((2, 4), cp.float64)[:, 1],
             cp.zeros(2, cp.complex64), cp.zeros(3, cp.int16)]]
    dist.all_gather_coalesced(outs, ins, group=pg)
    for got, want in zip(outs[0], ins):
        np.testing.assert_array_equal(to_host(got), to_host(want))
    cp.cuda.runtime.deviceSynchronize()  # a misaligned kernel would fail here at the latest


def test_device_id_selects_the_device():
    """init_process_group(device_id=...) makes it CuPy's current device: arrays made
    afterwards are on it, and NCCL's communicator is created there at init."""
    from spmd.core import cuda as _gpu

    dist = _initialised()
    if dist.get_world_size() != 1:
        pytest.skip("WORLD on NCCL needs one GPU per rank")
    cp = _gpu.cupy_or_none()
    last = cp.cuda.runtime.getDeviceCount() - 1
    before = cp.cuda.runtime.getDevice()
    dist.destroy_process_group()
    try:
        dist.init_process_group(device_id=f"cuda:{last}", timeout=TEST_TIMEOUT)
        assert cp.cuda.runtime.getDevice() == last
        assert dist.get_backend() == "cpu:mpi,cuda:nccl"
        x = cp.ones(4, cp.float32)
        assert x.device.id == last
        dist.all_reduce(x)  # accepted: on the rank's device
        assert dist.GroupMember.WORLD.engines["cuda"].communicator.device == last
    finally:
        dist.destroy_process_group()
        cp.cuda.Device(before).use()
        dist.init_process_group(timeout=TEST_TIMEOUT)


def _world_nccl(dist, desc):
    n = dist.get_world_size()
    why = nccl_ranks_skip_reason(n)
    if why is not None or n == 1:
        pytest.skip(why or "needs two ranks")
    return dist.new_group(backend="cpu:mpi,cuda:nccl", group_desc=desc)


def test_blocking_recv_orders_the_callers_stream():
    """recv() returns when the caller's stream is ordered after the receive: reading
    the buffer at once sees the new data, never the old."""
    dist = _initialised()
    from spmd.core import cuda as _gpu

    cp = _gpu.cupy_or_none()
    pg = _world_nccl(dist, "nccl-p2p")
    me, n = dist.get_rank(), dist.get_world_size()
    count = 1 << 24  # 64 MiB: the receive is still running when recv() returns
    try:
        for step in range(3):
            if me == 0:
                for peer in range(1, n):
                    dist.send(cp.full(count, float(step + peer), cp.float32), dst=peer, group=pg)
            else:
                buf = cp.full(count, -1.0, cp.float32)
                assert dist.recv(buf, src=0, group=pg) == 0
                got = buf[::1 << 20].get()  # on the caller's (current) stream
                np.testing.assert_array_equal(got, np.full(16, step + me, np.float32))
    finally:
        dist.destroy_process_group(pg)


def test_uneven_roots_avg_and_complex_on_several_ranks():
    """The paths a group of one never reaches: grouped calls with uneven sizes, roots
    other than 0, AVG (NCCL's own) and complex as pairs of reals, byte counts in wide
    and narrow units."""
    from spmd.core import cuda as _gpu

    dist = _initialised()
    cp = _gpu.cupy_or_none()
    pg = _world_nccl(dist, "nccl-multi")
    me, n = dist.get_rank(), dist.get_world_size()
    try:
        x = cp.full(5, float(me), cp.float32)
        dist.all_reduce(x, op=dist.ReduceOp.AVG, group=pg)
        np.testing.assert_allclose(x.get(), np.full(5, (n - 1) / 2), rtol=1e-6)
        z = cp.full(3, me + 1j * me, cp.complex128)
        dist.all_reduce(z, group=pg)
        s = n * (n - 1) / 2
        np.testing.assert_array_equal(z.get(), np.full(3, s + 1j * s))
        outs = [cp.zeros(r + 1, cp.int64) for r in range(n)]  # uneven all_gather
        dist.all_gather(outs, cp.full(me + 1, me, cp.int64), group=pg)
        for r, o in enumerate(outs):
            np.testing.assert_array_equal(o.get(), np.full(r + 1, r))
        root = n - 1
        for nbytes in (1, 2, 6, 12, 40, 4096 + 3):  # every unit, and odd sizes
            b = cp.full(nbytes, me, cp.uint8)
            dist.broadcast(b, src=root, group=pg)
            np.testing.assert_array_equal(b.get(), np.full(nbytes, root, np.uint8))
        view = cp.zeros(20, cp.uint8)[1:17]  # a contiguous view at an odd address
        view[...] = me
        dist.broadcast(view, src=root, group=pg)
        np.testing.assert_array_equal(view.get(), np.full(16, root, np.uint8))
        glist = [cp.zeros(2, cp.float64) for _ in range(n)] if me == root else None
        dist.gather(cp.full(2, float(me)), glist, dst=root, group=pg)
        if me == root:
            for r, g in enumerate(glist):
                np.testing.assert_array_equal(g.get(), [r, r])
        ins = [cp.arange(3, dtype=cp.int8), cp.full(2, float(me))]
        lists = [[cp.zeros(3, cp.int8), cp.zeros(2)] for _ in range(n)]
        dist.all_gather_coalesced(lists, ins, group=pg)
        for r, (a, b) in enumerate(lists):
            np.testing.assert_array_equal(a.get(), [0, 1, 2])
            np.testing.assert_array_equal(b.get(), [r, r])
    finally:
        dist.destroy_process_group(pg)


def test_two_ranks_on_one_gpu_get_a_clear_error():
    """Without NCCL_HOSTID, ranks sharing the GPU are refused before NCCL is called, on
    every rank alike, with the fixes named (NCCL itself says only "invalid usage")."""
    import os

    from spmd.core import cuda as _gpu

    dist = _initialised()
    cp = _gpu.cupy_or_none()
    n = dist.get_world_size()
    if n == 1 or os.environ.get("NCCL_HOSTID"):
        pytest.skip("needs two ranks without NCCL_HOSTID")
    if cp.cuda.runtime.getDeviceCount() >= n or on_device_double():
        pytest.skip("each rank could have its own GPU here")
    pg = dist.new_group(backend="cpu:mpi,cuda:nccl", group_desc="shared-gpu")
    try:
        with pytest.raises(RuntimeError, match=r"all_reduce: group ranks 0 and 1 .* would share "
                           r"one GPU .*backend='cpu:mpi,cuda:mpi'.*NCCL_HOSTID"):
            dist.all_reduce(cp.ones(2), group=pg)
    finally:
        dist.destroy_process_group(pg)
