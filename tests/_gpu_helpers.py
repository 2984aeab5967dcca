"""Shared pieces of the GPU tests: the skip reasons, cupy copies of numpy layouts, and
groups whose GPU arrays go through a chosen path."""

from __future__ import annotations

import os

import numpy as np
import pytest

from spmd.backends import gpu_aware_mpi as _aware
from spmd.core import cuda as _gpu


def gpu_skip_reason() -> str | None:
    """Why GPU tests cannot run here (None when they can)."""
    cp = _gpu.cupy_or_none()
    if cp is None:
        return f"no CuPy: {_gpu.cupy_problem()}"
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver
        return f"no usable CUDA device ({type(exc).__name__}: {exc})"
    return None if count > 0 else "no CUDA device visible"


def nccl_skip_reason() -> str | None:
    why = gpu_skip_reason()
    if why is not None:
        return why
    return None if _gpu.nccl_available() else f"no NCCL: {_gpu.nccl_problem()}"


def on_device_double() -> bool:
    """True when spmd.testing.device_double stands in for CuPy (SPMD_TEST_DEVICE=double)."""
    from spmd.testing import device_double

    return _gpu.cupy_or_none() is device_double.cupy


def nccl_ranks_skip_reason(world_size: int) -> str | None:
    """Why NCCL cannot join ``world_size`` ranks here: they share the one GPU, and NCCL
    refuses that unless each rank sets its own NCCL_HOSTID (tests/gpu/run.sh does).  The
    device double gives every rank a GPU of its own."""
    why = nccl_skip_reason()
    if why is not None:
        return why
    if world_size == 1 or os.environ.get("NCCL_HOSTID") or on_device_double():
        return None
    return ("NCCL refuses two ranks of one communicator on one GPU; run with a different "
            "NCCL_HOSTID per rank (and NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 "
            "NCCL_SOCKET_IFNAME=lo), as tests/gpu/run.sh does")


def cupy():
    why = gpu_skip_reason()
    if why is not None:
        pytest.skip(why)
    return _gpu.cupy_or_none()


def cupy_dtypes(dtypes):
    """The dtypes CuPy can hold and copy here.  Probed with a strided copy, an
    elementwise kernel: CuPy 13 makes bfloat16 arrays (a memset) but has no copy kernel
    for them, and the tests build strided inputs with such copies."""
    cp = _gpu.cupy_or_none()
    out = []
    for dt in dtypes:
        try:
            host = np.arange(6).astype(dt).reshape(2, 3)
            base = cp.zeros((2, 6), dt)
            base[:, ::2] = cp.asarray(host)
            if not np.array_equal(cp.ascontiguousarray(base[:, ::2]).get(), host):
                continue
        except Exception:  # noqa: BLE001
            continue
        out.append(dt)
    return out


def to_device(cp, host: np.ndarray, layout: str = "contig"):
    """A cupy array equal to ``host``; for "strided", a view with every other column."""
    if layout == "strided":
        base = cp.zeros((host.shape[0], 2 * host.shape[1]), host.dtype) if host.ndim == 2 else None
        if base is not None:
            view = base[:, ::2]
            view[...] = cp.asarray(host)
            return view
    return cp.asarray(host)


def to_host(a) -> np.ndarray:
    return a.get()


class mpi_mode:
    """Within the block, new groups' GPU arrays take the given MPI path."""

    def __init__(self, mode: str):
        self.value = {"staging": "0", "direct": "1"}[mode]

    def __enter__(self):
        self.old = os.environ.get(_aware.AWARE_ENV)
        os.environ[_aware.AWARE_ENV] = self.value
        return self

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop(_aware.AWARE_ENV, None)
        else:
            os.environ[_aware.AWARE_ENV] = self.old


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
