"""The collective suite with cupy arrays: on the MPI backend through pinned host
staging, and handed to MPI directly where MPI is GPU-aware; and on NCCL (at world size
1, or with a different NCCL_HOSTID per rank when ranks share a GPU, as tests/gpu/run.sh
does).  Every rank checks its results against numpy references.  Skips (with the
reason) without CuPy or a GPU.

Run on a GPU machine: tests/gpu/run.sh
"""

import numpy as np
import pytest
from _gpu_helpers import (
    cupy,
    cupy_dtypes,
    gpu_skip_reason,
    mpi_mode,
    nccl_ranks_skip_reason,
    to_device,
    to_host,
)
from conftest import _initialised, all_dtypes
from mpi4py import MPI
from refs import PREMUL_FACTOR, REDUCE_OPS, assert_equal, make, reduce_ref, supported

from spmd.backends import gpu_aware_mpi as _aware

pytestmark = pytest.mark.mpi
if gpu_skip_reason() is not None:
    pytest.skip(gpu_skip_reason(), allow_module_level=True)

GPU_LAYOUTS = ["contig", "strided", "scalar", "empty"]
SHAPES = {"contig": (3, 5), "strided": (3, 5), "scalar": (), "empty": (0,)}


def _dtypes():
    return cupy_dtypes(all_dtypes()) if gpu_skip_reason() is None else []


def _op(dist, name):
    return dist.make_premul_sum(PREMUL_FACTOR) if name == "PREMUL_SUM" else getattr(dist.ReduceOp, name)


def _same_bits(got, expect):
    got = np.ascontiguousarray(got)
    expect = np.ascontiguousarray(expect)
    assert got.dtype == expect.dtype and got.shape == expect.shape, (got.dtype, got.shape, expect.shape)
    width = got.dtype.itemsize // (2 if got.dtype.kind == "c" else 1)
    np.testing.assert_array_equal(got.view(f"u{width}"), expect.view(f"u{width}"))


def _finish(work, async_op):
    """torch's Work semantics: ``wait()`` orders the caller's current stream after the
    operation without blocking the host (a device Work may still be running when it
    returns); once that stream has synchronised, the Work is complete."""
    if async_op:
        assert work.wait() is True
        cupy().cuda.get_current_stream().synchronize()
        assert work.is_completed() and work.is_success()
    else:
        assert work is None


def _expect(gpu, dt, opname) -> str:
    """"ok", or "raises" (TypeError before anything is sent), or "skip" (no reference)."""
    if gpu["mode"] != "nccl":
        return "ok" if supported(dt, opname) else "raises"
    from spmd.backends.nccl.plans import plan_for

    if type(plan_for(dt, opname)) is str:
        return "raises"
    if not supported(dt, opname) or (opname == "PREMUL_SUM" and dt.name == "bfloat16"):
        return "skip"  # scaling bfloat16 needs CuPy arithmetic on it
    return "ok"


@pytest.fixture(scope="module", params=["staging", "direct", "nccl"])
def gpu(request):
    """cupy, and WORLD-sized and parity groups whose GPU arrays take one path."""
    cp = cupy()

    mode = request.param
    dist = _initialised()
    n = dist.get_world_size()
    if mode == "direct":
        found = _aware.decide_gpu_awareness(MPI.Get_library_version(),
                                          _aware.query_cuda_support()[0], {})
        if not found.aware:
            pytest.skip(f"MPI here is not GPU-aware: {found.reason}")
    if mode == "nccl" and nccl_ranks_skip_reason(n) is not None:
        pytest.skip(nccl_ranks_skip_reason(n))
    spec = "cpu:mpi,cuda:nccl" if mode == "nccl" else "cpu:mpi,cuda:mpi"
    with mpi_mode("staging" if mode == "nccl" else mode):
        world = dist.new_group(backend=spec, group_desc=f"gpu-{mode}")
        halves = [list(range(0, n, 2))] + ([list(range(1, n, 2))] if n > 1 else [])
        parity = dist.split_group(split_ranks=halves, group_desc=f"gpu-{mode}-parity",
                                  backend=spec)
        for pg in (world, parity):
            backend = pg.engine_for("cuda")
            if mode == "nccl":
                assert type(backend).__name__ == "NCCLEngine"
            else:
                assert backend.direct == (mode == "direct")
    yield {"cp": cp, "dist": dist, "world": world, "parity": parity, "mode": mode}
    if dist.is_initialized():
        dist.destroy_process_group(parity)
        dist.destroy_process_group(world)


@pytest.mark.parametrize("layout", GPU_LAYOUTS)
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("group_kind", ["world", "parity"])
@pytest.mark.parametrize("opname", REDUCE_OPS)
def test_all_reduce(gpu, opname, group_kind, async_op, layout):
    cp, dist, pg = gpu["cp"], gpu["dist"], gpu[group_kind]
    members, me = dist.get_process_group_ranks(pg), dist.get_rank()
    for dt in _dtypes():
        x = to_device(cp, make(me, SHAPES[layout], dt, opname), layout)
        expect = _expect(gpu, dt, opname)
        if expect == "raises":
            with pytest.raises(TypeError, match="all_reduce: "):
                dist.all_reduce(x, op=_op(dist, opname), group=pg, async_op=async_op)
            continue
        if expect == "skip":
            continue
        expect = reduce_ref([make(r, SHAPES[layout], dt, opname) for r in members], opname, dt)
        _finish(dist.all_reduce(x, op=_op(dist, opname), group=pg, async_op=async_op), async_op)
        assert isinstance(x, cp.ndarray)
        assert_equal(to_host(x), expect, f"{opname} {dt} {layout}")


@pytest.mark.parametrize("group_kind", ["world", "parity"])
@pytest.mark.parametrize("opname", REDUCE_OPS)
def test_reduce_family(gpu, opname, group_kind):
    cp, dist, pg = gpu["cp"], gpu["dist"], gpu[group_kind]
    members, me, gr, n = dist.get_process_group_ranks(pg), dist.get_rank(), pg.rank(), pg.size()
    for dt in _dtypes():
        if _expect(gpu, dt, opname) != "ok":
            continue
        op = _op(dist, opname)
        # reduce to the last member
        x = to_device(cp, make(me, (4,), dt, opname))
        dist.reduce(x, dst=members[-1], op=op, group=pg)
        if me == members[-1]:
            expect = reduce_ref([make(r, (4,), dt, opname) for r in members], opname, dt)
            assert_equal(to_host(x), expect, f"reduce {opname} {dt}")
        else:
            _same_bits(to_host(x), make(me, (4,), dt, opname))
        # reduce_scatter_tensor: rank i gets chunk i
        full = [make(r, (n * 2, 3), dt, opname) for r in members]
        out = cp.zeros((2, 3), dt)
        dist.reduce_scatter_tensor(out, to_device(cp, full[gr]), op=op, group=pg)
        assert_equal(to_host(out), reduce_ref([f[2 * gr:2 * gr + 2] for f in full], opname, dt))
        # reduce_scatter, uneven: rank i gets i + 1 elements
        ins = [to_device(cp, make(me, (i + 1,), dt, opname, salt=i)) for i in range(n)]
        out = cp.zeros((gr + 1,), dt)
        dist.reduce_scatter(out, ins, op=op, group=pg, async_op=True).wait()
        expect = reduce_ref([make(r, (gr + 1,), dt, opname, salt=gr) for r in members], opname, dt)
        assert_equal(to_host(out), expect, f"reduce_scatter {opname} {dt}")
        # all_reduce_coalesced with a strided member
        a = to_device(cp, make(me, (3, 5), dt, opname), "strided")
        b = to_device(cp, make(me, (2,), dt, opname, salt=1))
        dist.all_reduce_coalesced([a, b], op=op, group=pg)
        assert_equal(to_host(a), reduce_ref([make(r, (3, 5), dt, opname) for r in members], opname, dt))
        assert_equal(to_host(b), reduce_ref([make(r, (2,), dt, opname, salt=1) for r in members],
                                            opname, dt))


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("group_kind", ["world", "parity"])
def test_movement(gpu, group_kind, async_op):
    cp, dist, pg = gpu["cp"], gpu["dist"], gpu[group_kind]
    members, me, gr, n = dist.get_process_group_ranks(pg), dist.get_rank(), pg.rank(), pg.size()
    for dt in _dtypes():
        # broadcast from each member, contiguous and strided
        for i, src in enumerate(members):
            layout = "strided" if i % 2 else "contig"
            x = to_device(cp, make(me, (3, 5), dt), layout)
            _finish(dist.broadcast(x, src=src, group=pg, async_op=async_op), async_op)
            _same_bits(to_host(x), make(src, (3, 5), dt))
        # all_gather, uneven (rank i has i rows), one strided output
        outs = [cp.zeros((i, 3), dt) for i in range(n)]
        outs[-1] = cp.zeros((n - 1, 6), dt)[:, ::2]
        _finish(dist.all_gather(outs, to_device(cp, make(me, (gr, 3), dt)), group=pg,
                                async_op=async_op), async_op)
        for i, o in enumerate(outs):
            _same_bits(to_host(o), make(members[i], (i, 3), dt))
        # all_gather_into_tensor, stacked
        out = cp.zeros((n, 2, 3), dt)
        _finish(dist.all_gather_into_tensor(out, to_device(cp, make(me, (2, 3), dt)), group=pg,
                                            async_op=async_op), async_op)
        _same_bits(to_host(out), np.stack([make(r, (2, 3), dt) for r in members]))
        # gather to the first member, scatter from the last
        root = members[0]
        glist = [cp.zeros((2,), dt) for _ in range(n)] if me == root else None
        _finish(dist.gather(to_device(cp, make(me, (2,), dt)), glist, dst=root, group=pg,
                            async_op=async_op), async_op)
        if me == root:
            for r, g in zip(members, glist):
                _same_bits(to_host(g), make(r, (2,), dt))
        src = members[-1]
        slist = [to_device(cp, make(src, (3,), dt, salt=i)) for i in range(n)] if me == src else None
        out = cp.zeros((3,), dt)
        _finish(dist.scatter(out, slist, src=src, group=pg, async_op=async_op), async_op)
        _same_bits(to_host(out), make(src, (3,), dt, salt=gr))
        # all_to_all, uneven: rank i sends j + 1 rows to rank j
        ins = [to_device(cp, make(me, (j + 1, 2), dt, salt=j)) for j in range(n)]
        outs = [cp.zeros((gr + 1, 2), dt) for _ in range(n)]
        _finish(dist.all_to_all(outs, ins, group=pg, async_op=async_op), async_op)
        for i, o in enumerate(outs):
            _same_bits(to_host(o), make(members[i], (gr + 1, 2), dt, salt=gr))
        # all_to_all_single with split sizes: rank i sends i + j + 1 rows to rank j
        in_splits = [gr + j + 1 for j in range(n)]
        out_splits = [i + gr + 1 for i in range(n)]
        a = to_device(cp, make(me, (sum(in_splits), 2), dt))
        out = cp.zeros((sum(out_splits), 2), dt)
        _finish(dist.all_to_all_single(out, a, out_splits, in_splits, group=pg,
                                       async_op=async_op), async_op)
        pieces = []
        for i, r in enumerate(members):
            theirs = make(r, (sum(i + j + 1 for j in range(n)), 2), dt)
            start = sum(i + j + 1 for j in range(gr))
            pieces.append(theirs[start:start + i + gr + 1])
        _same_bits(to_host(out), np.concatenate(pieces))
        # all_gather_coalesced
        ins = [to_device(cp, make(me, (2,), dt)), to_device(cp, make(me, (3,), dt, salt=1))]
        outs = [[cp.zeros((2,), dt), cp.zeros((3,), dt)] for _ in range(n)]
        fut = dist.all_gather_coalesced(outs, ins, group=pg, async_op=async_op)
        if async_op:
            fut.wait()
        for r, (o1, o2) in zip(members, outs):
            _same_bits(to_host(o1), make(r, (2,), dt))
            _same_bits(to_host(o2), make(r, (3,), dt, salt=1))


def test_point_to_point(gpu):
    cp, dist, pg = gpu["cp"], gpu["dist"], gpu["world"]
    n, me = dist.get_world_size(), dist.get_rank()
    if n < 2:
        pytest.skip("point-to-point needs two ranks")
    right, left = (me + 1) % n, (me - 1) % n
    for dt in _dtypes():
        out = cp.zeros((3, 5), dt)[:, ::2] if dt.itemsize > 1 else cp.zeros((3, 3), dt)
        mine = to_device(cp, make(me, out.shape, dt))
        if gpu["mode"] == "nccl":
            # One NCCL stream per group runs its operations in order: a ring of receives
            # posted first would wait forever, so even ranks send first.
            for sending in ((True, False) if me % 2 == 0 else (False, True)):
                if sending:
                    dist.send(mine, dst=right, group=pg)
                else:
                    assert dist.recv(out, src=left, group=pg) == left
        else:
            recv = dist.irecv(out, src=left, group=pg)
            dist.send(mine, dst=right, group=pg)
            recv.wait()
            assert recv.source_rank() == left
        _same_bits(to_host(out), make(left, out.shape, dt))
        got = cp.zeros((4,), dt)
        ops = [dist.P2POp(dist.isend, to_device(cp, make(me, (4,), dt, salt=1)), right, pg),
               dist.P2POp(dist.irecv, got, left, pg)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        _same_bits(to_host(got), make(left, (4,), dt, salt=1))
    dist.barrier(group=pg)


def test_streams_and_mixed_arguments(gpu):
    cp, dist, pg = gpu["cp"], gpu["dist"], gpu["world"]
    n = dist.get_world_size()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:  # the producer runs on a side stream: the backend must wait for it
        x = cp.arange(1 << 20, dtype=cp.float32)
        x *= 2
        dist.all_reduce(x, group=pg)
    stream.synchronize()  # NCCL orders the side stream after the op, not the host
    np.testing.assert_array_equal(to_host(x)[:3], np.array([0, 2, 4], np.float32) * n)
    with pytest.raises(TypeError, match=r"output_tensor is a cpu array|input_tensor is a cuda array"):
        dist.all_gather_into_tensor(np.zeros(2 * n, np.float32), cp.zeros(2, cp.float32), group=pg)
    with pytest.raises(TypeError, match=r"tensor_list\[0\] is a cpu array"):
        dist.all_gather([np.zeros(1)] * n, cp.zeros(1), group=pg)


def test_device_of_another_gpu_is_refused(gpu):
    cp, dist = gpu["cp"], gpu["dist"]
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    current = cp.cuda.runtime.getDevice()
    with cp.cuda.Device((current + 1) % 2):
        x = cp.ones(2)
    with pytest.raises(ValueError, match=rf"tensor is on cuda:{(current + 1) % 2} but this rank "
                       rf"works on cuda:{current}"):
        dist.all_reduce(x, group=gpu["world"])


def test_torch_cuda_tensors(gpu):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    dist, pg, n = gpu["dist"], gpu["world"], gpu["dist"].get_world_size()
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t, group=pg)
    assert t.device.type == "cuda" and torch.equal(t.cpu(), torch.full((4,), float(n)))
    b = torch.ones(3, device="cuda", dtype=torch.bfloat16)
    dist.all_reduce(b, op=dist.ReduceOp.AVG, group=pg)
    assert torch.equal(b.cpu(), torch.ones(3, dtype=torch.bfloat16))
