"""GPU support on every rank of a job, without a GPU: mixed host/device arguments,
user backends from register_backend, the default backends per device, ``spmd info``,
NCCL's reduction plans and which ops GPU-aware MPI takes directly (the decisions alone:
tests/unit/test_gpu_host_decisions.py)."""

import collections

import numpy as np
import pytest
from _gpu_helpers import FakeCudaArray, FakeDLPack, FakeNccl
from conftest import TEST_TIMEOUT, all_dtypes

import spmd
from spmd.backends import gpu_aware_mpi as _aware
from spmd.backends.nccl import engine as nccl_backend
from spmd.backends.nccl.communicator import Communicator
from spmd.core import cuda as _gpu

DTYPES = all_dtypes()



# -- GPU-aware MPI detection ----------------------------------------------------------

OMPI = "Open MPI v5.0.3, package: Open MPI builder, ident: 5.0.3, repo rev: v5.0.3"
MPICH = "MPICH Version:      4.2.0\nMPICH Release date: Fri Feb  9 2024"


# -- NCCL tables ----------------------------------------------------------------------

@pytest.mark.mpi
def test_mixed_host_and_device_arguments_raise(dist):
    x, g = np.zeros(4, np.float32), FakeCudaArray()
    with pytest.raises(TypeError, match=r"all_gather_into_tensor: input_tensor is a cuda array but "
                       r"output_tensor is a cpu array; .* on the host or all on the GPU "
                       r"\[rank \d+, group WORLD\]"):
        spmd.all_gather_into_tensor(np.zeros(4 * dist.get_world_size(), np.float32), g)
    n = dist.get_world_size()
    with pytest.raises(TypeError, match=r"all_to_all: input_tensor_list\[0\] is a cuda array"):
        spmd.all_to_all([x] * n, [g] * n)
    with pytest.raises(TypeError, match=r"gather_list\[1\] is a cuda array"):
        spmd.gather(x, [x, g] + [x] * (n - 2) if n > 1 else [x, g], dst=dist.get_rank())
    with pytest.raises(TypeError, match=r"reduce_scatter: input_list\[0\] is a cpu array but output"):
        spmd.reduce_scatter(FakeDLPack(2), [x] * n)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"tensors\[1\] is a cuda array but tensors\[0\] is a cpu"):
        spmd.all_reduce_coalesced([torch.zeros(2), g])
    with pytest.raises(TypeError, match=r"tensor is on the meta device, which holds no data"):
        spmd.all_reduce(torch.empty(2, device="meta"))


@pytest.mark.mpi
def test_gpu_array_without_cupy_is_a_clear_error(dist):
    if _gpu.cupy_or_none() is not None:
        pytest.skip("CuPy is importable here")
    with pytest.raises(RuntimeError, match=r"all_reduce: tensor \(a GPU array\) needs CuPy: CuPy is "
                       r"not installed; pip install cupy-cuda12x"):
        spmd.all_reduce(FakeCudaArray())


def _unregister(name):
    from spmd.backends import registry as backend_registry

    backend_registry.backend_factories.pop(name, None)
    backend_registry.backend_devices.pop(name, None)
    if hasattr(spmd.Backend, name.upper()):
        delattr(spmd.Backend, name.upper())


def _reinit(dist):
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(timeout=TEST_TIMEOUT)


@pytest.mark.mpi
def test_user_backend_factory_runs(dist):
    from spmd.backends.mpi.engine import MPIEngine

    calls = collections.Counter()

    class Counting(MPIEngine):
        name = "counting"

        def all_reduce(self, a, op):
            calls["all_reduce", self.group.size] += 1
            return super().all_reduce(a, op)

    spmd.register_backend("counting", Counting, devices=["cpu"])
    n = dist.get_world_size()
    try:
        dist.destroy_process_group()
        dist.init_process_group(backend="counting", timeout=TEST_TIMEOUT)
        assert dist.get_backend() == "counting"
        x = np.ones(3)
        dist.all_reduce(x)
        np.testing.assert_array_equal(x, np.full(3, n))
        assert calls["all_reduce", n] == 1
        half = dist.new_group(list(range(0, n, 2)), backend="cpu:counting")
        if half:
            y = np.ones(2)
            dist.all_reduce(y, group=half)
            assert y[0] == half.size() and calls["all_reduce", half.size()] >= 1
        plain = dist.new_group(backend="mpi")
        z = np.ones(1)
        dist.all_reduce(z, group=plain)
        assert z[0] == n and sum(calls.values()) == (2 if half else 1)
    finally:
        _reinit(dist)
        _unregister("counting")


@pytest.mark.mpi
def test_default_backend_picks_nccl_when_importable(dist, monkeypatch):
    from spmd.runtime import world

    assert dist.get_backend() == ("cpu:mpi,cuda:nccl" if dist.is_nccl_available() else "mpi")
    monkeypatch.setattr(world, "is_nccl_available", lambda: True)
    monkeypatch.setattr(_gpu, "nccl_problem", lambda: None)
    try:
        dist.destroy_process_group()
        dist.init_process_group(timeout=TEST_TIMEOUT)
        assert dist.get_backend() == "cpu:mpi,cuda:nccl"
        assert spmd.Backend.device_map(dist.get_backend()) == {"cpu": "mpi", "cuda": "nccl"}
        x = np.ones(2)
        dist.all_reduce(x)  # host arrays still go to MPI
        assert x[0] == dist.get_world_size()
        dist.barrier()
    finally:
        monkeypatch.undo()
        _reinit(dist)


@pytest.mark.mpi
def test_device_id_checked_at_init(dist):
    dist.destroy_process_group()
    try:
        with pytest.raises(ValueError, match="device_id must be 'cuda' or 'cuda:N'"):
            dist.init_process_group(device_id="cpu:0")
        assert not dist.is_initialized()
        dist.init_process_group(backend="mpi", device_id=0, timeout=TEST_TIMEOUT)  # no eager GPU work
        x = np.ones(1)
        dist.all_reduce(x)
        assert x[0] == dist.get_world_size()
    finally:
        _reinit(dist)


@pytest.mark.mpi
def test_spmd_info_reports_gpu_facts(dist):
    from spmd.tools.cli import _rank_info

    info = _rank_info()
    assert info["gpu_aware_mpi"].startswith(("yes (", "no ("))
    for key in ("cupy", "nccl", "cuda_device", "mpi_library", "thread_level"):
        assert info[key]
    if _gpu.cupy_or_none() is None:
        assert info["cupy"].startswith("unavailable (CuPy is not installed")


# The NCCL Work's stream semantics, reaping, errors and timeouts run on the device double:
# tests/gpu/test_gpu_nccl_double.py.


# -- NCCL versions: split, AVG/bfloat16, broadcast counts ------------------------------------

@pytest.mark.mpi
def test_nccl_split_waits_for_the_parent_stream(dist):
    """ncclCommSplit runs only after the parent's stream has drained (outstanding work on
    the parent can deadlock a split)."""
    events = []

    class Stream:
        def synchronize(self):
            events.append("parent stream synchronized")

    class Comm:
        def commSplit(self, color, key):
            events.append(f"commSplit({color}, {key})")
            return "child communicator"

    class Device:
        def __init__(self, index):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    parent = dist.GroupMember.WORLD
    cp = type("cp", (), {"cuda": type("cuda", (), {"Device": Device, "runtime": None})})
    nc = Communicator(parent.context, cp, FakeNccl(21805, 21805))
    nc.nccl_comm, nc.stream, nc.device = Comm(), Stream(), 0
    b = object.__new__(nccl_backend.NCCLEngine)
    b.communicator = nc
    child = type("Child", (), {"backend_name": "undefined", "inherited": {}})()
    b.on_split(child, 3, 1)
    assert events == ["parent stream synchronized", "commSplit(3, 1)"]
    assert child.inherited["cuda"] == "child communicator"  # init's default backend takes it


@pytest.mark.mpi
def test_nccl_plan_uses_avg_only_when_libnccl_has_it(dist):
    b = object.__new__(nccl_backend.NCCLEngine)
    b.group, b._resolved = dist.GroupMember.WORLD.context, {}
    b._nccl = FakeNccl(20903)  # CuPy defines NCCL_AVG, but libnccl 2.9 has no ncclAvg
    _, _, nop, divide = b._plan(np.dtype(np.float32), spmd.ReduceOp.AVG, "all_reduce")
    assert (nop, divide) == (FakeNccl.NCCL_SUM, "float")
    b._nccl, b._resolved = FakeNccl(21805), {}
    _, _, nop, divide = b._plan(np.dtype(np.float32), spmd.ReduceOp.AVG, "all_reduce")
    assert (nop, divide) == (FakeNccl.NCCL_AVG, None)
    bf16 = next((d for d in DTYPES if d.name == "bfloat16"), None)
    if bf16 is not None:
        b._nccl, b._resolved = FakeNccl(20903), {}
        with pytest.raises(TypeError, match=r"all_reduce: bfloat16 arrays: the NCCL library "
                           r"loaded \(version code 20903\) has no bfloat16 .* \[rank \d+, "
                           r"group WORLD\]"):
            b._plan(bf16, spmd.ReduceOp.SUM, "all_reduce")


# -- GPU-aware MPI on Open MPI: only point to point gets device pointers -----------------------

class Recorder:
    """Stands in for the communicator and the staging helpers: records which path ran."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append(name)
            return "request"
        return record


@pytest.mark.mpi
@pytest.mark.parametrize("library, direct_ops", [
    (OMPI, {"send", "recv"}),
    (MPICH, {"send", "recv", "broadcast", "all_gather_into_tensor", "all_to_all_single"}),
])
def test_cuda_mpi_paths_per_library(dist, monkeypatch, library, direct_ops):
    """With a GPU-aware MPI, Open MPI gets device pointers only in Isend/Irecv (its
    nonblocking collectives are not CUDA-aware outside UCX); MPICH in collectives too."""
    from spmd.backends import cuda_mpi

    support = _aware.decide_gpu_awareness(library, 1, {})
    b = object.__new__(cuda_mpi.CudaMPIEngine)
    b.group, b.rank = dist.GroupMember.WORLD.context, dist.get_rank()
    b.direct = support.aware
    b.direct_collectives = support.aware and support.nonblocking_collectives
    b.direct_reductions = support.aware and support.nonblocking_reductions
    b.comm, b.host = Recorder(), Recorder()
    staged = []
    monkeypatch.setattr(b, "_sync", lambda: None, raising=False)
    monkeypatch.setattr(b, "_down", lambda arrays: [np.zeros(1) for _ in arrays], raising=False)
    monkeypatch.setattr(b, "_host_outputs", lambda arrays: [np.zeros(1) for _ in arrays],
                        raising=False)
    monkeypatch.setattr(b, "_staged", lambda work, pairs, outs: staged.append(work),
                        raising=False)
    monkeypatch.setattr(b, "_direct", lambda reqs, op, *rest: op, raising=False)
    monkeypatch.setattr(cuda_mpi, "Work", None)  # every direct call goes through _direct
    import spmd.core.arrays

    monkeypatch.setattr(spmd.core.arrays, "movable", lambda a: a)
    a = np.zeros(4)
    calls = {
        "send": lambda: b.send(a, 0, 0), "recv": lambda: b.recv(a, 0, 0),
        "broadcast": lambda: b.broadcast(a, 0),
        "all_gather_into_tensor": lambda: b.all_gather_into_tensor(a, a),
        "all_to_all_single": lambda: b.all_to_all_single(a, a, None, None),
    }
    for name, call in calls.items():
        before = len(staged)
        result = call()
        went_direct = len(staged) == before
        assert went_direct == (name in direct_ops), (library, name)
        if went_direct:
            assert result == name
