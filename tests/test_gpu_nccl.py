"""The NCCL backend on a real GPU.  NCCL refuses two ranks of one communicator on the
same GPU, so on a one-GPU machine it runs for real in groups of size 1 (at any world
size) and as WORLD at world size 1; that still exercises lazy and eager creation, the
unique-id bootstrap (over MPI and through a store), commSplit, the communication
stream and its events, Work semantics, and the dtype/op tables.  Skips (with the
reason) without CuPy, NCCL or a GPU."""

import numpy as np
import pytest
from _gpu_helpers import cupy_dtypes, nccl_skip_reason, to_device, to_host
from conftest import TEST_TIMEOUT, _initialised, all_dtypes
from refs import PREMUL_FACTOR, make

pytestmark = pytest.mark.mpi
if nccl_skip_reason() is not None:
    pytest.skip(nccl_skip_reason(), allow_module_level=True)

NCCL_DTYPES = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
               "float64", "bfloat16", "complex64", "complex128", "bool"]


def _dtypes():
    return [dt for dt in cupy_dtypes(all_dtypes()) if dt.name in NCCL_DTYPES]


@pytest.fixture(scope="module")
def solo():
    """cupy, spmd and this rank's own NCCL group of size 1."""
    from spmd import _gpu

    dist = _initialised()
    pg, _ = dist.new_subgroups(group_size=1, backend="cpu:mpi,cuda:nccl", group_desc="solo")
    yield _gpu.cupy_or_none(), dist, pg
    if dist.is_initialized():
        dist.destroy_process_group(pg)


def test_lazy_creation_and_unique_id(solo):
    cp, dist, pg = solo
    backend = pg._backend_for("cuda")
    assert type(backend).__name__ == "NCCLBackend" and backend._comm is None
    x = cp.arange(4, dtype=cp.float32)
    dist.all_reduce(x, group=pg)
    assert backend._comm is not None and backend.created_by == "unique id"
    assert backend._comm.size() == 1 and backend._comm.rank_id() == 0
    np.testing.assert_array_equal(to_host(x), np.arange(4, dtype=np.float32))


def test_reductions_in_a_group_of_one(solo):
    cp, dist, pg = solo
    for dt in _dtypes():
        for opname in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM", "BAND", "BXOR"):
            host = make(0, (3, 5), dt, opname)
            x = to_device(cp, host, "strided")
            op = (dist.make_premul_sum(PREMUL_FACTOR) if opname == "PREMUL_SUM"
                  else getattr(dist.ReduceOp, opname))
            from spmd.backends._nccl_plans import plan_for

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
    backend = pg._backend_for("cuda")
    backend._reap()
    assert all(w.is_completed() for w in many) and len(backend._inflight) <= 1


def test_nccl_only_group_and_store_bootstrap():
    from spmd import _gpu
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
        assert dist.GroupMember.WORLD._backends["cuda"].created_by == "unique id"
        assert store.num_keys() >= 1  # the id went through the store
    finally:
        dist.destroy_process_group()
        dist.init_process_group(timeout=TEST_TIMEOUT)


def test_eager_init_and_comm_split():
    from spmd import _gpu

    dist = _initialised()
    if dist.get_world_size() != 1:
        pytest.skip("WORLD on NCCL needs one GPU per rank")
    cp = _gpu.cupy_or_none()
    dist.destroy_process_group()
    try:
        dist.init_process_group(backend="cpu:mpi,cuda:nccl", device_id=cp.cuda.runtime.getDevice(),
                                timeout=TEST_TIMEOUT)
        world_nccl = dist.GroupMember.WORLD._backends["cuda"]
        assert world_nccl._comm is not None and world_nccl.created_by == "unique id"
        sub, _ = dist.new_subgroups(group_size=1)
        x = cp.ones(2)
        dist.all_reduce(x, group=sub)
        expected = "commSplit" if world_nccl.can_split() else "unique id"
        assert sub._backends["cuda"].created_by == expected
    finally:
        dist.destroy_process_group()
        dist.init_process_group(timeout=TEST_TIMEOUT)
