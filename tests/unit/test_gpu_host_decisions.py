"""The parts of GPU support that need no GPU, tested for real on every machine: backend
strings and selection, register_backend with a user backend that runs, GPU-aware MPI
detection (library strings, the environment override, MPIX_Query_cuda_support through
ctypes on the MPI library loaded here), NCCL dtype/op tables and unique ids, device
detection of raw arguments, mixed host/device arguments (the NCCL engine itself runs on
the device double: tests/gpu/test_gpu_nccl_double.py)."""

import os
from types import SimpleNamespace

import numpy as np
import pytest
from _gpu_helpers import FakeCudaArray, FakeDLPack, FakeNccl
from conftest import all_dtypes
from mpi4py import MPI

import spmd
from spmd.backends import gpu_aware_mpi as _aware
from spmd.backends.cuda_mpi import direct_plan
from spmd.backends.nccl import creation, plans, uniqueid
from spmd.backends.staging import use_device_pointer
from spmd.core import cuda as _gpu
from spmd.core.arrays import device_of

DTYPES = all_dtypes()



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
    got = _aware.decide_gpu_awareness(version, query, env)
    assert (got.aware, got.nonblocking_reductions) == (aware, nonblocking)
    # Open MPI's nonblocking collectives are not CUDA-aware (outside UCX): staged there.
    assert got.nonblocking_collectives == (aware and "Open MPI" not in version)
    assert reason in got.reason


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_gpu_awareness_bad_override(value):
    with pytest.raises(ValueError, match=f"SPMD_CUDA_AWARE_MPI='{value}' is not a valid "
                       "setting: expected one of 0, 1"):
        _aware.decide_gpu_awareness(MPICH, None, {"SPMD_CUDA_AWARE_MPI": value})


def test_query_cuda_support_on_the_loaded_mpi(monkeypatch):
    paths = _aware.mpi_library_paths()
    assert paths and all(os.path.basename(p).startswith(("libmpi", "libmpich")) for p in paths)
    result, where = _aware.query_cuda_support()
    version = MPI.Get_library_version()
    if version.startswith("MPICH Version") and int(version.split()[2].split(".")[0]) >= 4:
        # MPICH 4+ exports it; what it answers depends on the build and the machine.
        assert result in (0, 1) and where in paths
    if result is None:
        assert where == ""
    monkeypatch.delenv("SPMD_CUDA_AWARE_MPI", raising=False)
    decided = _aware.mpi_gpu_support()
    if result is not None:
        assert decided.aware == (result == 1)
        assert f"MPIX_Query_cuda_support() returned {result}" in decided.reason
    monkeypatch.setenv("SPMD_CUDA_AWARE_MPI", "1")
    assert _aware.mpi_gpu_support().aware
    monkeypatch.setenv("SPMD_CUDA_AWARE_MPI", "0")
    assert not _aware.mpi_gpu_support().aware


def test_query_cuda_support_without_the_symbol():
    import ctypes.util

    libc = ctypes.util.find_library("c")
    assert _aware.query_cuda_support([libc or "libc.so.6", "/nonexistent/libmpi.so"]) == (None, "")


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
        wire = uniqueid.uid_to_bytes(uid)
        assert isinstance(wire, bytes) and not wire.startswith(b"error:")
        back = uniqueid.uid_for_cupy(wire)
        assert back == uid and type(back) is type(uid)
    assert max(uniqueid.uid_for_cupy(uniqueid.uid_to_bytes(unsigned))) == 255
    assert min(uniqueid.uid_for_cupy(uniqueid.uid_to_bytes(signed))) == -127
    assert uniqueid.uid_for_cupy(uniqueid.uid_to_bytes(bytearray(raw))) == raw
    with pytest.raises(ValueError, match="not an NCCL unique id"):
        uniqueid.uid_for_cupy(b"garbage")
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


def test_barrier_device_choice():
    from spmd.api.collectives import _barrier_device

    class PG:
        def __init__(self, spec):
            self.context, self.engines = SimpleNamespace(backend_name=spec), {}

    assert _barrier_device(PG("mpi"), None) == "cpu"
    assert _barrier_device(PG("nccl"), None) == "cuda"
    assert _barrier_device(PG("cpu:mpi,cuda:nccl"), None) == "cpu"
    assert _barrier_device(PG("cpu:mpi,cuda:nccl"), [0]) == "cuda"
    assert _barrier_device(PG("gloo"), [0]) == "cpu"


# The NCCL Work's stream semantics, reaping, errors and timeouts run on the device double:
# tests/gpu/test_gpu_nccl_double.py.


# -- NCCL versions: split, AVG/bfloat16, broadcast counts ------------------------------------

@pytest.mark.parametrize("runtime, build, split, expected", [
    (21805, 21805, True, True),
    (21805, 21703, True, False),   # CuPy built against NCCL < 2.18 raises in commSplit
    (21703, 21805, True, False),   # the libnccl loaded is too old
    (22305, None, True, False),    # no get_build_version: cannot tell, do not split
    (22305, 22305, False, False),  # CuPy without commSplit
])
def test_nccl_can_split_needs_runtime_and_build_versions(runtime, build, split, expected):
    assert creation.can_split(FakeNccl(runtime, build, split)) is expected


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
    assert uniqueid.host_identity() == "NCCL_HOSTID=rank3"
    monkeypatch.delenv("NCCL_HOSTID")
    import socket

    assert uniqueid.host_identity().startswith(socket.gethostname())


# -- GPU-aware MPI on Open MPI: only point to point gets device pointers -----------------------


# -- GPU arrays on links: the path, with numpy through the same code -------------------

A = _aware.GpuAwareness


@pytest.mark.parametrize("support, contiguous, collective, direct", [
    (A(True, "MPICH aware", True), True, False, True),
    (A(True, "MPICH aware", True), True, True, True),
    (A(True, "Open MPI aware", False), True, False, True),    # its Isend/Irecv read GPUs
    (A(True, "Open MPI aware", False), True, True, False),    # its Ibcast does not
    (A(False, "not aware", False), True, False, False),
    (A(True, "MPICH aware", True), False, False, False),      # a strided view: staged
])
def test_link_gpu_path_decision(support, contiguous, collective, direct):
    a = np.zeros((3, 4))
    assert use_device_pointer(support, a if contiguous else a[:, ::2], collective) == direct
