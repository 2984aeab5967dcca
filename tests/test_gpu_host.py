"""The parts of GPU support that need no GPU, tested for real on every machine: backend
strings and selection, register_backend with a user backend that runs, GPU-aware MPI
detection (library strings, the environment override, MPIX_Query_cuda_support through
ctypes on the MPI library loaded here), NCCL dtype/op tables and unique ids, device
detection of raw arguments, mixed host/device arguments (the NCCL engine itself runs on
the device double: tests/test_gpu_nccl_double.py)."""

import collections
import os

import numpy as np
import pytest
from conftest import TEST_TIMEOUT, all_dtypes
from mpi4py import MPI

import spmd
from spmd.backends.cuda_mpi import direct_plan
from spmd.backends.nccl import engine as nccl_backend
from spmd.backends.nccl import plans
from spmd.core import cuda as _gpu
from spmd.core.arrays import device_of

DTYPES = all_dtypes()


class FakeCudaArray:
    """Exposes ``__cuda_array_interface__`` (never dereferenced: checks fail first)."""

    def __init__(self, shape=(4,), typestr="<f4"):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (0xDEAD0000, False), "version": 3}


class FakeDLPack:
    def __init__(self, device_type):
        self.device_type = device_type

    def __dlpack_device__(self):
        return (self.device_type, 0)

    def __dlpack__(self, stream=None):  # pragma: no cover - never imported
        raise AssertionError("not to be imported")


# -- GPU-aware MPI detection ----------------------------------------------------------

OMPI = "Open MPI v5.0.3, package: Open MPI builder, ident: 5.0.3, repo rev: v5.0.3"
OMPI4 = "Open MPI v4.1.6, package: Open MPI conda@builder Distribution, ident: 4.1.6"
MPICH = "MPICH Version:      4.2.0\nMPICH Release date: Fri Feb  9 2024"


@pytest.mark.parametrize("version, query, env, aware, nonblocking, reason", [
    (OMPI, 1, {}, True, False, "MPIX_Query_cuda_support() returned 1"),
    (OMPI, 0, {}, False, False, "returned 0"),
    (MPICH, 1, {}, True, True, "MPIX_Query_cuda_support() returned 1 (MPICH Version:"),
    (MPICH, 0, {}, False, False, "returned 0"),
    (MPICH, 0, {"SPMD_CUDA_AWARE_MPI": "1"}, True, True, "SPMD_CUDA_AWARE_MPI=1"),
    (OMPI, 1, {"SPMD_CUDA_AWARE_MPI": "0"}, False, False, "SPMD_CUDA_AWARE_MPI=0"),
    (OMPI, None, {"SPMD_CUDA_AWARE_MPI": " 1 "}, True, False, "SPMD_CUDA_AWARE_MPI=1"),
    (MPICH, 1, {"SPMD_CUDA_AWARE_MPI": ""}, True, True, "returned 1"),
    ("MVAPICH2-GDR Version 2.3.7", None, {}, True, True, "built for GPU buffers"),
    ("MPI VERSION    : CRAY MPICH version 8.1.28", None, {"MPICH_GPU_SUPPORT_ENABLED": "1"},
     True, True, "MPICH_GPU_SUPPORT_ENABLED=1"),
    ("MPI VERSION    : CRAY MPICH version 8.1.28", None, {}, False, False, "(unset)"),
    ("Intel(R) MPI Library 2021.10", None, {}, False, False, "set SPMD_CUDA_AWARE_MPI=1"),
    # Open MPI < 5 answers for the build: CUDA must also be switched on for the run.
    (OMPI4, 1, {}, False, False, "set OMPI_MCA_opal_cuda_support=true"),
    (OMPI4, 1, {"OMPI_MCA_opal_cuda_support": "false"}, False, False, "Open MPI < 5"),
    (OMPI4, 1, {"OMPI_MCA_opal_cuda_support": "true"}, True, False,
     f"returned 1 ({OMPI4}) and OMPI_MCA_opal_cuda_support=true"),
    (OMPI4, 1, {"SPMD_CUDA_AWARE_MPI": "1"}, True, False, "SPMD_CUDA_AWARE_MPI=1"),
    (OMPI4, 0, {"OMPI_MCA_opal_cuda_support": "true"}, False, False, "returned 0"),
])
def test_gpu_awareness_decision(version, query, env, aware, nonblocking, reason):
    got = _gpu.decide_gpu_awareness(version, query, env)
    assert (got.aware, got.nonblocking_reductions) == (aware, nonblocking)
    # Open MPI's nonblocking collectives are not CUDA-aware (outside UCX): staged there.
    assert got.nonblocking_collectives == (aware and "Open MPI" not in version)
    assert reason in got.reason


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_gpu_awareness_bad_override(value):
    with pytest.raises(ValueError, match=f"SPMD_CUDA_AWARE_MPI must be 0 or 1, got '{value}'"):
        _gpu.decide_gpu_awareness(MPICH, None, {"SPMD_CUDA_AWARE_MPI": value})


def test_query_cuda_support_on_the_loaded_mpi(monkeypatch):
    paths = _gpu.mpi_library_paths()
    assert paths and all(os.path.basename(p).startswith(("libmpi", "libmpich")) for p in paths)
    result, where = _gpu.query_cuda_support()
    version = MPI.Get_library_version()
    if version.startswith("MPICH Version") and int(version.split()[2].split(".")[0]) >= 4:
        # MPICH 4+ exports it; what it answers depends on the build and the machine.
        assert result in (0, 1) and where in paths
    if result is None:
        assert where == ""
    monkeypatch.delenv("SPMD_CUDA_AWARE_MPI", raising=False)
    decided = _gpu.mpi_gpu_support()
    if result is not None:
        assert decided.aware == (result == 1)
        assert f"MPIX_Query_cuda_support() returned {result}" in decided.reason
    monkeypatch.setenv("SPMD_CUDA_AWARE_MPI", "1")
    assert _gpu.mpi_gpu_support().aware
    monkeypatch.setenv("SPMD_CUDA_AWARE_MPI", "0")
    assert not _gpu.mpi_gpu_support().aware


def test_query_cuda_support_without_the_symbol():
    import ctypes.util

    libc = ctypes.util.find_library("c")
    assert _gpu.query_cuda_support([libc or "libc.so.6", "/nonexistent/libmpi.so"]) == (None, "")


def test_direct_mpi_plans():
    assert direct_plan(np.dtype(np.float32), spmd.ReduceOp.SUM).simple
    assert direct_plan(np.dtype(np.bool_), spmd.ReduceOp.MAX).view == np.uint8
    for dt, op in ((np.float16, spmd.ReduceOp.SUM), (np.float32, spmd.ReduceOp.AVG),
                   (np.float32, spmd.make_premul_sum(2.0)), (np.float32, spmd.ReduceOp.BAND)):
        assert direct_plan(np.dtype(dt), op) is None  # staged: arithmetic, or an error


# -- NCCL tables ----------------------------------------------------------------------

def _nccl_rule(dt: np.dtype, op: str):
    """The documented NCCL rules, written out independently of the table."""
    bitwise = op in ("BAND", "BOR", "BXOR")
    if dt == np.bool_:
        return op in ("SUM", "MAX", "BOR", "PRODUCT", "MIN", "BAND")
    if dt.name in ("int16", "uint16"):
        return False
    if dt.kind in "iu":
        return not bitwise and op != "PREMUL_SUM"
    if dt.kind == "c":
        return op in ("SUM", "AVG", "PREMUL_SUM")
    return not bitwise


@pytest.mark.parametrize("op", plans.REDUCE_NAMES)
def test_nccl_reduction_table(op):
    for dt in DTYPES:
        plan = plans.plan_for(dt, op)
        assert (type(plan) is not str) == _nccl_rule(dt, op), (dt, op, plan)
        if type(plan) is str:
            if dt.name in ("int16", "uint16") or (dt.kind in "iub" and op in ("BAND", "BOR", "BXOR")):
                assert "backend='cpu:mpi,cuda:mpi'" in plan, plan
            continue
        assert plan.count_factor == (2 if dt.kind == "c" else 1)
        assert plan.nccl_type == plans.NCCL_TYPES[dt.name]
        assert plan.premul == (op == "PREMUL_SUM")
        if op == "AVG":
            assert plan.avg == ("float" if dt.kind in "fcV" or dt.name == "bfloat16" else
                                {"i": "int", "u": "uint"}[dt.kind])


def test_nccl_type_names():
    wanted = {"int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
              "float64", "bfloat16", "complex64", "complex128"}
    assert wanted <= set(plans.NCCL_TYPES)
    assert plans.NCCL_TYPES["complex128"] == "NCCL_FLOAT64"
    assert plans.plan_for(np.dtype(np.bool_), "SUM").nccl_op == "NCCL_MAX"
    assert plans.plan_for(np.dtype(np.bool_), "PRODUCT").nccl_op == "NCCL_MIN"
    assert "complex arrays as pairs of reals" in plans.plan_for(np.dtype(np.complex64), "MAX")


def test_nccl_unique_id_forms():
    """The id comes back exactly as get_unique_id() gave it: bytes (CuPy 14), or a tuple
    of chars (CuPy 13), signed on x86 and unsigned on aarch64, never re-signed."""
    raw = bytes((2 * i + 1) % 256 for i in range(128))  # 1, 3, ..., 255
    signed = tuple(b - 256 if b > 127 else b for b in raw)  # x86: char is signed
    unsigned = tuple(raw)                                    # aarch64: char is unsigned
    for uid in (raw, signed, unsigned):
        wire = plans.uid_to_bytes(uid)
        assert isinstance(wire, bytes) and not wire.startswith(b"error:")
        back = plans.uid_for_cupy(wire)
        assert back == uid and type(back) is type(uid)
    assert max(plans.uid_for_cupy(plans.uid_to_bytes(unsigned))) == 255
    assert min(plans.uid_for_cupy(plans.uid_to_bytes(signed))) == -127
    assert plans.uid_for_cupy(plans.uid_to_bytes(bytearray(raw))) == raw
    with pytest.raises(ValueError, match="not an NCCL unique id"):
        plans.uid_for_cupy(b"garbage")
    assert _gpu.nccl_version_code(21805) == "2.18.5"
    assert _gpu.nccl_version_code(2408) == "2.4.8"


# -- devices ----------------------------------------------------------------------------

def test_device_index():
    assert _gpu.device_index(None) is None
    assert _gpu.device_index(3) == 3
    assert _gpu.device_index("cuda:1") == 1
    assert _gpu.device_index("CUDA") is None
    for bad in ("cpu", "cuda:x", -1, True, 2.0):
        with pytest.raises(ValueError):
            _gpu.device_index(bad)
    torch = pytest.importorskip("torch")
    assert _gpu.device_index(torch.device("cuda", 2)) == 2
    with pytest.raises(ValueError):
        _gpu.device_index(torch.device("cpu"))


def test_device_of_raw_arguments():
    class Sub(np.ndarray):
        pass

    assert device_of(np.zeros(2)) == "cpu"
    assert device_of(np.zeros(2).view(Sub)) == "cpu"
    assert device_of(FakeCudaArray()) == "cuda"
    assert device_of(FakeDLPack(2)) == "cuda"
    assert device_of(FakeDLPack(13)) == "cuda"
    assert device_of(FakeDLPack(1)) == "cpu"
    assert device_of([1, 2]) is None and device_of(None) is None
    torch = pytest.importorskip("torch")
    assert device_of(torch.zeros(2)) == "cpu"
    assert device_of(torch.empty(2, device="meta")) == "meta"


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


# -- backend strings, selection and registration ---------------------------------------

def test_device_map_with_registered_names():
    spmd.register_backend("hostonly", lambda g: None, devices=["cpu"])
    try:
        assert spmd.Backend.device_map("hostonly") == {"cpu": "hostonly"}
        assert spmd.Backend.device_map("cpu:hostonly,cuda:nccl") == {"cpu": "hostonly",
                                                                   "cuda": "nccl"}
        assert spmd.Backend.HOSTONLY == "hostonly"
        with pytest.raises(ValueError, match="already registered"):
            spmd.register_backend("HostOnly", lambda g: None)
    finally:
        _unregister("hostonly")
    for bad_name in ("mpi", "nccl", "gloo", "two words", 3):
        with pytest.raises(ValueError):
            spmd.register_backend(bad_name, lambda g: None)
    with pytest.raises(ValueError, match="devices"):
        spmd.register_backend("tpuish", lambda g: None, devices=["tpu"])
    with pytest.raises(TypeError, match="callable"):
        spmd.register_backend("notcallable", 3)
    with pytest.raises(ValueError, match="unknown backend 'hostonly'"):
        spmd.Backend("hostonly")


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
    from spmd.backends.mpi.engine import MPIBackend

    calls = collections.Counter()

    class Counting(MPIBackend):
        name = "counting"

        def all_reduce(self, a, op):
            calls["all_reduce", self.group.size()] += 1
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


def test_barrier_device_choice():
    from spmd.api.collectives import _barrier_device

    class PG:
        def __init__(self, spec):
            self._backend_name, self._backends = spec, {}

    assert _barrier_device(PG("mpi"), None) == "cpu"
    assert _barrier_device(PG("nccl"), None) == "cuda"
    assert _barrier_device(PG("cpu:mpi,cuda:nccl"), None) == "cpu"
    assert _barrier_device(PG("cpu:mpi,cuda:nccl"), [0]) == "cuda"
    assert _barrier_device(PG("gloo"), [0]) == "cpu"


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
# tests/test_gpu_nccl_double.py.


# -- NCCL versions: split, AVG/bfloat16, broadcast counts ------------------------------------

class FakeNccl:
    """What spmd reads of ``cupy.cuda.nccl``: version functions and constant names."""

    NCCL_SUM, NCCL_PROD, NCCL_MIN, NCCL_MAX, NCCL_AVG = range(5)
    NCCL_FLOAT32, NCCL_BFLOAT16, NCCL_INT32, NCCL_UINT8, NCCL_FLOAT16 = range(10, 15)

    def __init__(self, runtime, build=None, split=True):
        self._runtime, self._build = runtime, build
        self.NcclCommunicator = type("NcclCommunicator", (), {"commSplit": None} if split else {})
        if build is not None:
            self.get_build_version = lambda: self._build

    def get_version(self):
        return self._runtime


@pytest.mark.parametrize("runtime, build, split, expected", [
    (21805, 21805, True, True),
    (21805, 21703, True, False),   # CuPy built against NCCL < 2.18 raises in commSplit
    (21703, 21805, True, False),   # the libnccl loaded is too old
    (22305, None, True, False),    # no get_build_version: cannot tell, do not split
    (22305, 22305, False, False),  # CuPy without commSplit
])
def test_nccl_can_split_needs_runtime_and_build_versions(runtime, build, split, expected):
    b = object.__new__(nccl_backend.NCCLBackend)
    b._nccl = FakeNccl(runtime, build, split)
    assert b.can_split() is expected


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
    b = object.__new__(nccl_backend.NCCLBackend)
    b._nccl, b._comm, b._broken, b._stream, b._device = FakeNccl(21805, 21805), Comm(), None, \
        Stream(), 0
    b._cp = type("cp", (), {"cuda": type("cuda", (), {"Device": Device})})
    child = type("Child", (), {"_backend_name": "undefined", "_inherited": {}})()
    b.group = parent
    b.on_split(child, 3, 1)
    assert events == ["parent stream synchronized", "commSplit(3, 1)"]
    assert child._inherited["cuda"] == "child communicator"  # init's default backend takes it


@pytest.mark.parametrize("runtime, dtype, op, native_avg, refused", [
    (21805, "float32", "AVG", True, None),
    (20903, "float32", "AVG", False, None),     # NCCL 2.9: sum, then divide
    (20903, "float32", "SUM", False, None),
    (21805, "bfloat16", "AVG", True, None),
    (20903, "bfloat16", "SUM", False, "has no bfloat16"),
    (21805, "int32", "AVG", False, None),       # integer AVG is always sum + truncation
])
def test_nccl_avg_and_bfloat16_follow_the_runtime_version(runtime, dtype, op, native_avg, refused):
    if dtype == "bfloat16":
        dt = next((d for d in DTYPES if d.name == "bfloat16"), None)
        if dt is None:
            pytest.skip("ml_dtypes is not installed")
    else:
        dt = np.dtype(dtype)
    plan = plans.plan_for(dt, op)
    got_avg, why = plans.runtime_plan(plan, runtime)
    assert got_avg is native_avg
    assert (why is None) == (refused is None)
    if refused:
        assert refused in why and "backend='cpu:mpi,cuda:mpi'" in why


@pytest.mark.mpi
def test_nccl_plan_uses_avg_only_when_libnccl_has_it(dist):
    b = object.__new__(nccl_backend.NCCLBackend)
    b.group, b._resolved = dist.GroupMember.WORLD, {}
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


def test_nccl_broadcast_counts_in_wide_units():
    assert plans.byte_units(16, 256) == ("NCCL_UINT64", 2)
    assert plans.byte_units(12, 256) == ("NCCL_UINT32", 3)
    assert plans.byte_units(6, 256) == ("NCCL_FLOAT16", 3)
    assert plans.byte_units(16, 258) == ("NCCL_FLOAT16", 8)  # the address decides too
    assert plans.byte_units(7, 256) == ("NCCL_UINT8", 7)
    big = 3 * 2**30  # 3 GiB: a byte count over a C int, 8-byte units under it
    unit, count = plans.byte_units(big, 0)
    assert unit == "NCCL_UINT64" and count <= plans.INT_MAX < big
    for version, old in (("13.0.0", True), ("13.3.0", True), ("13.4.0", False),
                         ("13.6.0", False), ("14.0.1", False), ("12.3.0", False)):
        assert plans.cupy_count_is_int(version) is old, version


def test_nccl_host_identity(monkeypatch):
    monkeypatch.setenv("NCCL_HOSTID", "rank3")
    assert plans.host_identity() == "NCCL_HOSTID=rank3"
    monkeypatch.delenv("NCCL_HOSTID")
    import socket

    assert plans.host_identity().startswith(socket.gethostname())


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

    support = _gpu.decide_gpu_awareness(library, 1, {})
    b = object.__new__(cuda_mpi.CudaMPIBackend)
    b.group, b.rank = dist.GroupMember.WORLD, dist.get_rank()
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
