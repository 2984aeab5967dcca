"""torch.distributed on the spmd backend: every op through torch's own API, checked
against numpy references on every rank, at every world size."""

from __future__ import annotations

import time
import warnings
from datetime import timedelta

import numpy as np
import pytest
from conftest import _initialised
from refs import PREMUL_FACTOR, REDUCE_OPS, assert_equal, make, reduce_ref, supported

torch = pytest.importorskip("torch", reason="torch is not installed")
tdist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.mpi

TORCH_DTYPES = [torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16,
                torch.float32, torch.float64, torch.complex64, torch.complex128]


@pytest.fixture(scope="module")
def td():
    """torch.distributed with the spmd backend as the default group (over spmd's WORLD,
    which the other test modules share)."""
    import spmd.torch  # noqa: F401 - registers also when autoload is off

    dist = _initialised()

    if not tdist.is_initialized():
        tdist.init_process_group("spmd", timeout=timedelta(seconds=60))
    assert tdist.get_backend() == "spmd"
    assert tdist.get_rank() == dist.get_rank()
    assert tdist.get_world_size() == dist.get_world_size()
    return tdist


def np_dtype(dt):
    import ml_dtypes

    if dt is torch.bfloat16:
        return np.dtype(ml_dtypes.bfloat16)
    return torch.empty(0, dtype=dt).numpy().dtype


def tensor(a: np.ndarray, dt) -> torch.Tensor:
    if dt is torch.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a)).clone()


def as_np(t: torch.Tensor, dt) -> np.ndarray:
    if dt is torch.bfloat16:
        return t.float().numpy().astype(np_dtype(dt))
    return t.numpy()


def torch_op(td, name):
    if name == "PREMUL_SUM":
        return td._make_nccl_premul_sum(PREMUL_FACTOR)
    return getattr(td.ReduceOp, name)


# torch before 2.13 does not show PREMUL_SUM's factor to a Python backend.
PREMUL_READABLE = hasattr(tdist._make_nccl_premul_sum(2.0), "factor")


@pytest.mark.parametrize("opname", REDUCE_OPS)
def test_all_reduce_every_dtype(td, opname):
    me, n = td.get_rank(), td.get_world_size()
    if opname == "PREMUL_SUM" and not PREMUL_READABLE:
        with pytest.raises(ValueError, match="torch before 2.13 does not show the factor"):
            td.all_reduce(torch.ones(2), op=torch_op(td, opname))
        return
    for dt in TORCH_DTYPES:
        ndt = np_dtype(dt)
        if not supported(ndt, opname):
            continue
        if dt.is_complex and opname == "PRODUCT":  # torch's API refuses it before any backend
            with pytest.raises(ValueError, match="does not support"):
                td.all_reduce(torch.ones(2, dtype=dt), op=td.ReduceOp.PRODUCT)
            continue
        x = tensor(make(me, (3, 4), ndt, opname), dt)
        work = td.all_reduce(x, op=torch_op(td, opname), async_op=True)
        assert work.wait() is True and work.is_completed() and work.exception() is None
        expect = reduce_ref([make(r, (3, 4), ndt, opname) for r in range(n)], opname, ndt)
        assert_equal(as_np(x, dt), expect, f"{opname} {dt}")


def test_unsupported_reduction_raises(td):
    with pytest.raises(TypeError if PREMUL_READABLE else ValueError,
                       match=r"all_reduce.*\[rank \d+, group WORLD\]" if PREMUL_READABLE
                       else "PREMUL_SUM needs a factor"):
        td.all_reduce(torch.ones(3, dtype=torch.int32), op=td._make_nccl_premul_sum(2.0))
    with pytest.raises(TypeError, match="moves but cannot reduce"):
        td.all_reduce(torch.zeros(3, dtype=torch.float8_e4m3fn))


def test_reduce_broadcast_strided(td):
    me, n = td.get_rank(), td.get_world_size()
    base = torch.zeros(4, 6, dtype=torch.float64)
    col = base[:, 1]  # a strided view: results land in it
    col.copy_(torch.arange(4, dtype=torch.float64) + me)
    td.reduce(col, dst=n - 1, op=td.ReduceOp.MAX)
    if me == n - 1:
        assert torch.equal(base[:, 1], torch.arange(4, dtype=torch.float64) + n - 1)
    assert float(base[:, 0].abs().sum()) == 0.0
    b = torch.full((5,), float(me), dtype=torch.bfloat16)
    td.broadcast(b, src=n - 1)
    assert torch.equal(b, torch.full((5,), float(n - 1), dtype=torch.bfloat16))


def test_gathers_and_scatters(td):
    me, n = td.get_rank(), td.get_world_size()
    # all_gather, uneven sizes: rank r contributes r + 1 elements
    outs = [torch.empty(r + 1, dtype=torch.int64) for r in range(n)]
    td.all_gather(outs, torch.full((me + 1,), me, dtype=torch.int64))
    for r in range(n):
        assert torch.equal(outs[r], torch.full((r + 1,), r, dtype=torch.int64))
    out = torch.empty(n * 2, dtype=torch.complex64)
    td.all_gather_into_tensor(out, torch.tensor([me, 1j * me], dtype=torch.complex64))
    np.testing.assert_array_equal(out.numpy(), np.array([[r, 1j * r] for r in range(n)],
                                                        np.complex64).reshape(-1))
    # gather/scatter rooted at the last rank
    root = n - 1
    glist = [torch.empty(3) for _ in range(n)] if me == root else None
    td.gather(torch.full((3,), float(me)), glist, dst=root)
    if me == root:
        assert all(torch.equal(glist[r], torch.full((3,), float(r))) for r in range(n))
    got = torch.empty(2, dtype=torch.uint64)
    slist = [torch.full((2,), r * 10, dtype=torch.uint64) for r in range(n)] if me == root \
        else None
    td.scatter(got, slist, src=root)
    assert torch.equal(got, torch.full((2,), me * 10, dtype=torch.uint64))
    # all_gather_coalesced: output[rank][j]
    outl = [[torch.empty(2), torch.empty(1)] for _ in range(n)]
    td.all_gather_coalesced(outl, [torch.full((2,), float(me)), torch.tensor([-me * 1.0])])
    for r in range(n):
        assert torch.equal(outl[r][0], torch.full((2,), float(r)))
        assert torch.equal(outl[r][1], torch.tensor([-r * 1.0]))
    objs = [None] * n
    td.all_gather_object(objs, {"rank": me})
    assert objs == [{"rank": r} for r in range(n)]


def test_reduce_scatter_and_all_to_all(td):
    me, n = td.get_rank(), td.get_world_size()
    ndt = np.dtype(np.float32)
    full = [make(r, (n * 3,), ndt) for r in range(n)]
    out = torch.empty(3)
    td.reduce_scatter_tensor(out, torch.from_numpy(full[me].copy()), op=td.ReduceOp.AVG)
    assert_equal(out.numpy(), reduce_ref([f[me * 3:me * 3 + 3] for f in full], "AVG", ndt))
    # reduce_scatter list form, uneven: destination r gets r + 1 elements
    ins = [torch.full((r + 1,), float(me + r)) for r in range(n)]
    out = torch.empty(me + 1)
    td.reduce_scatter(out, ins)
    assert torch.equal(out, torch.full((me + 1,), float(sum(p + me for p in range(n)))))
    # all_to_all_single with split sizes: rank s sends s + d + 1 rows to rank d
    in_splits = [me + d + 1 for d in range(n)]
    out_splits = [s + me + 1 for s in range(n)]
    inp = torch.cat([torch.full((k, 2), float(100 * me + d)) for d, k in enumerate(in_splits)])
    out = torch.empty(sum(out_splits), 2)
    td.all_to_all_single(out, inp, out_splits, in_splits)
    expect = torch.cat([torch.full((k, 2), float(100 * s + me)) for s, k in enumerate(out_splits)])
    assert torch.equal(out, expect)
    # all_to_all list form, peers of different sizes
    outs = [torch.empty(s + 1, dtype=torch.int16) for s in range(n)]
    td.all_to_all(outs, [torch.full((me + 1,), me * n + d, dtype=torch.int16) for d in range(n)])
    for s in range(n):
        assert torch.equal(outs[s], torch.full((s + 1,), s * n + me, dtype=torch.int16))


def test_all_gather_input_view_of_output(td):
    """FSDP2 hands all_gather_into_tensor an input that is a slice of its output."""
    me, n = td.get_rank(), td.get_world_size()
    out = torch.zeros(n * 1000)
    inp = out[me * 1000:(me + 1) * 1000]
    inp.copy_(torch.arange(1000.0) + me)
    td.all_gather_into_tensor(out, inp)
    expect = torch.cat([torch.arange(1000.0) + r for r in range(n)])
    assert torch.equal(out, expect)


def test_point_to_point(td):
    me, n = td.get_rank(), td.get_world_size()
    if n == 1:
        pytest.skip("point-to-point needs two ranks")
    right, left = (me + 1) % n, (me - 1) % n
    got = torch.empty(4, dtype=torch.float16)
    # a batch whose receives come first: blocking sends would deadlock it
    works = tdist.batch_isend_irecv([tdist.P2POp(tdist.irecv, got, left),
                                     tdist.P2POp(tdist.isend, torch.full((4,), float(me),
                                                 dtype=torch.float16), right)])
    for w in works:
        w.wait()
    assert torch.equal(got, torch.full((4,), float(left), dtype=torch.float16))
    if me == 0:
        senders = set()
        for _ in range(n - 1):
            buf = torch.empty(1, dtype=torch.int64)
            src = td.recv(buf)  # any source: torch asks the Work for its source rank
            assert int(buf) == src * 7
            senders.add(src)
        assert senders == set(range(1, n))
    else:
        td.send(torch.tensor([me * 7]), dst=0)


def test_futures_complete_without_wait(td):
    """DDP's reducer only waits on the future: it must complete on its own."""
    me, n = td.get_rank(), td.get_world_size()
    x = torch.full((1000,), float(me))
    fut = td.all_reduce(x, async_op=True).get_future()
    chained = fut.then(lambda f: f.value()[0] * 2)
    deadline = time.monotonic() + 30
    while not chained.done():  # nobody calls wait(): the poller completes it
        assert time.monotonic() < deadline, "future did not complete on its own"
        time.sleep(0.001)
    assert torch.equal(chained.value(), torch.full((1000,), 2.0 * sum(range(n))))
    assert torch.equal(x, torch.full((1000,), float(sum(range(n)))))


def test_coalescing_manager_and_subgroups(td):
    me, n = td.get_rank(), td.get_world_size()
    ts = [torch.full((k + 1,), float(me + k)) for k in range(5)]
    with tdist._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            td.all_reduce(t)
    cm.wait()
    for k, t in enumerate(ts):
        assert torch.equal(t, torch.full((k + 1,), float(sum(r + k for r in range(n)))))
    evens = list(range(0, n, 2))
    g = td.new_group(evens)
    x = torch.tensor([float(me)])
    if me in evens:
        assert td.get_backend(g) == "spmd" and g.group_name
        td.all_reduce(x, group=g)
        assert float(x) == float(sum(evens))
    else:
        assert g == tdist.GroupMember.NON_GROUP_MEMBER
    gloo = td.new_group(backend="gloo")  # backend= is honoured
    assert td.get_backend(gloo) == "gloo"
    y = torch.tensor([1.0])
    td.all_reduce(y, group=gloo)
    assert float(y) == n
    sub, _ = td.new_subgroups(group_size=1)
    z = torch.tensor([float(me)])
    td.all_reduce(z, group=sub)
    assert float(z) == me and td.get_world_size(sub) == 1


def test_functional_collectives_and_compile(td):
    import torch.distributed._functional_collectives as funcol

    me, n = td.get_rank(), td.get_world_size()
    group = tdist.group.WORLD
    out = funcol.all_reduce(torch.full((3,), float(me)), "sum", group)
    assert torch.equal(out, torch.full((3,), float(sum(range(n)))))
    g = funcol.all_gather_tensor(torch.tensor([float(me)]), 0, group)
    assert torch.equal(g, torch.arange(float(n)))

    def step(x):
        return funcol.all_reduce(x * 2, "sum", group) + 1

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    res = compiled(torch.full((4,), float(me)))
    assert torch.equal(res, torch.full((4,), 2.0 * sum(range(n)) + 1))


def test_wrong_size_raises_everywhere(td):
    me, n = td.get_rank(), td.get_world_size()
    with pytest.raises(ValueError, match=rf"all_gather_into_tensor: output_tensor has "
                       rf"{n * 3 + 1} elements.*\[rank {me}, group WORLD\]"):
        td.all_gather_into_tensor(torch.empty(n * 3 + 1), torch.empty(3))


def _ops_and_their_tensors(td, dt):
    """(op, call, every tensor the call hands the backend) for each op of torch's API."""
    me, n = td.get_rank(), td.get_world_size()
    root = n - 1

    def t(*shape):
        return torch.ones(*shape, dtype=dt)

    x, out, parts, outs = t(4), t(4 * n), [t(4) for _ in range(n)], [t(4) for _ in range(n)]
    gl = [t(4) for _ in range(n)] if me == root else None
    col = t(4, 3)[:, 1]  # a strided view
    yield "all_reduce", lambda: td.all_reduce(x), [x]
    yield "all_reduce strided", lambda: td.all_reduce(col), [col]
    yield "broadcast", lambda: td.broadcast(x, src=root), [x]
    yield "reduce", lambda: td.reduce(x, dst=root), [x]
    yield "all_gather", lambda: td.all_gather(outs, x), [x, *outs]
    yield "all_gather_into_tensor", lambda: td.all_gather_into_tensor(out, x), [out, x]
    yield "all_gather_coalesced", lambda: td.all_gather_coalesced([[o] for o in outs], [x]), \
        [x, *outs]
    yield "gather", lambda: td.gather(x, gl, dst=root), [x, *(gl or [])]
    yield "scatter", lambda: td.scatter(x, gl, src=root), [x, *(gl or [])]
    yield "reduce_scatter", lambda: td.reduce_scatter(x, parts), [x, *parts]
    yield "reduce_scatter_tensor", lambda: td.reduce_scatter_tensor(x, out), [x, out]
    yield "all_to_all", lambda: td.all_to_all(outs, parts), [*outs, *parts]
    yield "all_to_all_single", lambda: td.all_to_all_single(out, t(4 * n)), [out]
    ys = [t(3), t(2)]

    def coalesced():
        with tdist._coalescing_manager(async_ops=True) as cm:
            for y in ys:
                td.all_reduce(y)
        cm.wait()

    yield "coalescing_manager", coalesced, ys
    if n > 1:
        right, left = (me + 1) % n, (me - 1) % n
        s, r = t(4), t(4)

        def p2p():
            for w in tdist.batch_isend_irecv([tdist.P2POp(tdist.irecv, r, left),
                                              tdist.P2POp(tdist.isend, s, right)]):
                w.wait()

        yield "batch_isend_irecv", p2p, [s, r]


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float8_e4m3fn],
                         ids=str)
def test_every_tensor_stays_resizable(td, dt):
    """FSDP1 frees parameters by resizing their storage to 0: no op may leave a tensor it
    was handed changed in anything but its values (``Tensor.numpy()`` would mark the
    storage not resizable for good)."""
    for op, call, tensors in _ops_and_their_tensors(td, dt):
        if dt is torch.float8_e4m3fn and op.startswith(("all_reduce", "reduce", "coalesc")):
            continue  # moved, not reduced
        call()
        for i, t in enumerate(tensors):
            storage = t.untyped_storage()
            size = storage.nbytes()
            try:
                storage.resize_(0)
                storage.resize_(size)
            except RuntimeError as exc:
                raise AssertionError(f"{op} {dt}: tensor {i} is no longer resizable") from exc


def _tensors_without_dense_memory():
    """(kind, tensor, what spmd's error says) for every tensor kind the backend refuses."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR and nested tensors are "beta"
        yield "sparse_coo", torch.eye(3).to_sparse(), r"layout torch\.sparse_coo.*to_dense"
        yield "sparse_csr", torch.eye(3).to_sparse_csr(), r"layout torch\.sparse_csr"
        yield "mkldnn", torch.ones(3).to_mkldnn(), r"layout torch\._mkldnn"
        yield "quantized", torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8), \
            r"quantized tensor \(torch\.qint8\).*int_repr"
        yield "meta", torch.ones(3, device="meta"), r"meta device.*to_empty"
        yield "nested", torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), \
            r"nested tensor.*unbind"
        yield "nested_jagged", torch.nested.nested_tensor(
            [torch.ones(2, 4), torch.ones(3, 4)], layout=torch.jagged), r"nested tensor"


def test_tensors_without_dense_memory_get_spmd_errors(td):
    """Sparse, mkldnn, quantized, meta and nested tensors: spmd's own error, naming the op,
    the argument, what it got and what to move instead, on every rank before anything
    is sent (the group works on after them)."""
    me, n = td.get_rank(), td.get_world_size()
    where = rf"\[rank {me}, group WORLD\]"
    for kind, bad, says in _tensors_without_dense_memory():
        calls = {
            "all_reduce: tensor": lambda b=bad: td.all_reduce(b),
            "broadcast: tensor": lambda b=bad: td.broadcast(b, src=0),
            "all_gather_into_tensor: output_tensor":
                lambda b=bad: td.all_gather_into_tensor(b, torch.ones(3)),
            "all_to_all_single: input":  # (the output of the input's dtype: torch's check)
                lambda b=bad: td.all_to_all_single(torch.empty_like(b) if b.is_quantized
                                                   else torch.ones(3), b),
        }
        if kind == "quantized":  # torch refuses a qint8 output for a float input itself
            del calls["all_gather_into_tensor: output_tensor"]
        for prefix, call in calls.items():
            with pytest.raises(TypeError, match=rf"^{prefix} .*{says}.*{where}") as err:
                call()
            assert "numpy" not in str(err.value), (kind, prefix, str(err.value))
    x = torch.full((2,), float(me))
    td.all_reduce(x)
    assert torch.equal(x, torch.full((2,), float(sum(range(n)))))


def test_devices_torch_asks_the_group_for(td):
    """torch places object collectives and sharded state dicts by the group's device
    types (FSDP1's sharded state_dict failed with none); its helpers that look up a
    backend per device find the group itself."""
    from torch.distributed import distributed_c10d as c10d

    assert c10d._get_object_coll_device() == "cpu"
    assert "cpu" in c10d._device_capability()
    group = c10d._get_default_group()
    assert group._get_backend(torch.device("cpu")) is group
    with warnings.catch_warnings():  # torch: "only for nccl or gloo" (2.14: deprecated)
        warnings.simplefilter("ignore")
        c10d._set_pg_timeout(timedelta(seconds=60))  # raised when it found no backend
