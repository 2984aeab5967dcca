"""CUDA in one place: loading CuPy and NCCL, the rank's device, GPU-aware MPI detection.

Nothing here imports CuPy until a GPU array or a GPU backend needs it, so programs
that only move host arrays never pay for the import (nor initialise CUDA).
"""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np

from spmd.core.context import GroupContext
from spmd.core.dtypes import bfloat16
from spmd.core.errors import located

__all__ = [
    "as_device_array",
    "bound_device",
    "cupy_or_none",
    "cupy_problem",
    "device_array_type",
    "device_index",
    "empty_pinned",
    "nccl_available",
    "nccl_or_none",
    "nccl_problem",
    "nccl_version",
    "on_bound_device",
    "need_cupy",
    "select_device",
    "use_runtime",
]

_INSTALL_HINT = "pip install cupy-cuda12x or cupy-cuda13x, matching the CUDA driver"

_cupy = None
_cupy_problem: str | None = None
_cupy_loaded = False


class _NoDeviceArrays:
    """What ``device_array_type`` is while CuPy is not loaded: the type of no array."""


# cupy.ndarray once CuPy is loaded: the checks take an array of exactly this type
# straight to the device check (on_bound_device), the common GPU call.
device_array_type: type = _NoDeviceArrays
_nccl = None
_nccl_problem: str | None = None
_nccl_loaded = False


def cupy_or_none():
    """The cupy module, or None when it is not installed or does not import."""
    global _cupy, _cupy_problem, _cupy_loaded
    if not _cupy_loaded:
        _cupy_loaded = True
        if importlib.util.find_spec("cupy") is None:
            _cupy_problem = f"CuPy is not installed; {_INSTALL_HINT}"
        else:
            try:
                import cupy
            except Exception as exc:  # noqa: BLE001 - any import failure means "no CuPy"
                _cupy_problem = f"import cupy failed: {type(exc).__name__}: {exc}"
            else:
                _cupy = cupy
                _set_device_array_type()
    return _cupy


def _set_device_array_type() -> None:
    global device_array_type
    device_array_type = _cupy.ndarray if _cupy is not None else _NoDeviceArrays


def use_runtime(cupy_module, nccl_module) -> None:
    """Take ``cupy_module`` for CuPy and ``nccl_module`` for ``cupy.cuda.nccl`` from now
    on (``spmd.testing.device_double`` installs itself so); ``(None, None)`` looks for
    the real ones again."""
    global _cupy, _cupy_problem, _cupy_loaded, _nccl, _nccl_problem, _nccl_loaded
    _cupy, _nccl = cupy_module, nccl_module
    _cupy_problem = _nccl_problem = None
    _cupy_loaded = _nccl_loaded = cupy_module is not None
    _set_device_array_type()


def empty_pinned(cp, shape, dtype):
    """A numpy array in page-locked host memory (CuPy's pinned allocator)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    mem = cp.cuda.alloc_pinned_memory(count * dtype.itemsize)
    return np.ndarray(shape, dtype, buffer=mem)


def cupy_problem() -> str | None:
    """Why CuPy cannot be used here (None when it can be imported)."""
    cupy_or_none()
    return _cupy_problem


def need_cupy(op: str, what: str, group: GroupContext | None = None):
    """The cupy module; RuntimeError naming the op and the fix when it is missing."""
    cp = cupy_or_none()
    if cp is None:
        where = f" [rank {group.rank}, group {group.name}]" if group is not None else ""
        raise RuntimeError(f"{op}: {what} needs CuPy: {_cupy_problem}{where}")
    return cp


def nccl_or_none():
    """``cupy.cuda.nccl`` when CuPy is importable and its NCCL library loads, else None."""
    global _nccl, _nccl_problem, _nccl_loaded
    if not _nccl_loaded:
        _nccl_loaded = True
        cp = cupy_or_none()
        if cp is None:
            _nccl_problem = _cupy_problem
        else:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # CuPy 14 warns when libnccl is missing
                    from cupy.cuda import nccl
            except Exception as exc:  # noqa: BLE001
                _nccl_problem = f"cupy.cuda.nccl does not import: {exc}"
            else:
                # CuPy 14 imports the module and sets available=False without libnccl.
                if getattr(nccl, "available", True) and hasattr(nccl, "NcclCommunicator"):
                    _nccl = nccl
                else:
                    _nccl_problem = ("CuPy cannot load the NCCL library; pip install "
                                     "nvidia-nccl-cu12 (nvidia-nccl-cu13 for CUDA 13)")
    return _nccl


def nccl_problem() -> str | None:
    nccl_or_none()
    return _nccl_problem


def nccl_available() -> bool:
    """True when CuPy imports and its NCCL library loads."""
    return nccl_or_none() is not None


def nccl_version_code(code: int) -> str:
    """NCCL's version code as ``major.minor.patch`` (2.9+ codes are major*10000+...)."""
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def nccl_version() -> str | None:
    nccl = nccl_or_none()
    if nccl is None:
        return None
    try:
        return nccl_version_code(int(nccl.get_version()))
    except Exception:  # noqa: BLE001
        return None


# -- devices ----------------------------------------------------------------------

def device_index(device_id) -> int | None:
    """The CUDA device index named by ``device_id``: an int, ``"cuda:N"``, a
    ``torch.device`` or a ``cupy.cuda.Device``.  None for ``"cuda"`` without an index
    (the current device) and for None.

    Raises:
        ValueError: ``device_id`` names no CUDA device.
    """
    if device_id is None:
        return None
    if isinstance(device_id, bool):
        raise ValueError(f"device_id must name a CUDA device, got {device_id!r}")
    if isinstance(device_id, int):
        if device_id < 0:
            raise ValueError(f"device_id must be a non-negative device index, got {device_id}")
        return device_id
    if isinstance(device_id, str):
        kind, _, index = device_id.strip().lower().partition(":")
        if kind != "cuda" or (index and not index.isdigit()):
            raise ValueError(f"device_id must be 'cuda' or 'cuda:N', got {device_id!r}")
        return int(index) if index else None
    device_type = getattr(device_id, "type", None)
    if device_type is not None:  # torch.device
        if device_type != "cuda":
            raise ValueError(f"device_id must be a CUDA device, got {device_id!r}")
        return device_id.index
    device_number = getattr(device_id, "id", None)  # cupy.cuda.Device
    if isinstance(device_number, int):
        return device_number
    raise ValueError(f"device_id must be an int, 'cuda:N', a torch.device or a "
                     f"cupy.cuda.Device, got {type(device_id).__name__}")


# init_process_group's device_id (None: CuPy's current device).
_bound_device_id = None


def bind_device_id(device_id) -> None:
    """Remember the device this rank was bound to at init (None to forget it)."""
    global _bound_device_id
    _bound_device_id = device_id


def select_device(device_id) -> int | None:
    """Make ``device_id`` CuPy's current device (init_process_group's ``device_id``), so
    that arrays made afterwards, and the streams staging synchronises, are on it.

    Returns:
        The device index, or None when nothing was selected: ``"cuda"`` without an
        index, or no CuPy here (then no GPU array can reach spmd anyway).
    """
    index = device_index(device_id)
    cp = cupy_or_none() if index is not None else None
    if cp is None:
        return None
    cp.cuda.Device(index).use()
    return index


def bound_device() -> int:
    """The device this rank works on: init_process_group's ``device_id``, else CuPy's
    current device."""
    index = device_index(_bound_device_id)
    if index is not None:
        return index
    return int(cupy_or_none().cuda.runtime.getDevice())


def _torch_to_cupy(cp, x):
    t = x.detach()
    if str(t.dtype) == "torch.bfloat16":
        # CuPy's DLPack import may refuse bfloat16; move the bits and view them.
        if bfloat16 is None:
            raise TypeError("a bfloat16 tensor needs ml_dtypes (pip install ml_dtypes)")
        import torch

        return cp.from_dlpack(t.view(torch.int16)).view(bfloat16)
    return cp.from_dlpack(t)


def as_device_array(x, op: str, arg: str, group: GroupContext):
    """A cupy array sharing ``x``'s device memory (cupy arrays come back as they are).

    Raises:
        RuntimeError: CuPy is not importable.
        TypeError: CuPy cannot import ``x``.
        ValueError: ``x`` is on another device than the one this rank is bound to.
    """
    cp = need_cupy(op, f"{arg} (a GPU array)", group)
    if not isinstance(x, cp.ndarray):
        try:
            if type(x).__module__.startswith("torch"):
                x = _torch_to_cupy(cp, x)
            elif hasattr(x, "__cuda_array_interface__"):
                x = cp.asarray(x)
            else:
                x = cp.from_dlpack(x)
        except Exception as exc:  # noqa: BLE001
            raise located(TypeError, op, f"{arg}: CuPy cannot import this {type(x).__name__} "
                          f"({type(exc).__name__}: {exc})", group) from None
    return on_bound_device(x, op, arg, group)


def on_bound_device(x, op: str, arg: str, group: GroupContext):
    """``x`` (a cupy array) if it is on the device this rank is bound to.

    Raises:
        ValueError: ``x`` is on another device.
    """
    want = bound_device()
    if x.device.id != want:
        raise located(ValueError, op, f"{arg} is on cuda:{x.device.id} but this rank works on "
                      f"cuda:{want} (init_process_group's device_id, else CuPy's current "
                      "device)", group)
    return x


def gpu_info() -> dict:
    """What ``spmd info`` prints about GPUs for this rank (never raises)."""
    out: dict = {}
    cp = cupy_or_none()
    out["cupy"] = cp.__version__ if cp is not None else f"unavailable ({_cupy_problem})"
    version = nccl_version()
    out["nccl"] = version if version is not None else f"unavailable ({nccl_problem() or '?'})"
    if cp is None:
        out["cuda_device"] = "none (no CuPy)"
        return out
    try:
        count = cp.cuda.runtime.getDeviceCount()
        index = bound_device()
        props = cp.cuda.runtime.getDeviceProperties(index)
        name = props["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        gib = props.get("totalGlobalMem", 0) / 2**30
        out["cuda_device"] = f"cuda:{index} of {count}: {name}, {gib:.0f} GiB"
    except Exception as exc:  # noqa: BLE001 - no driver, no device
        out["cuda_device"] = f"none ({type(exc).__name__}: {exc})"
    return out
