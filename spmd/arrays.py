"""Array adapters and dtype tables: what spmd accepts and how MPI sees it."""

from __future__ import annotations

import numpy as np

from .errors import located

__all__ = ["SUPPORTED_DTYPES", "bfloat16"]

try:  # bfloat16 is optional: numpy has no native one
    from ml_dtypes import bfloat16 as _bf16

    bfloat16 = np.dtype(_bf16)
except ImportError:  # pragma: no cover - depends on the environment
    bfloat16 = None

_ndarray = np.ndarray

# dtype -> (family, dtype MPI moves it as).  MPI has no bool, float16 or bfloat16 it
# is guaranteed to know, so those travel as unsigned integers of the same width.
_FAMILY: dict[np.dtype, str] = {np.dtype(np.bool_): "bool"}
for _t in (np.int8, np.int16, np.int32, np.int64):
    _FAMILY[np.dtype(_t)] = "int"
for _t in (np.uint8, np.uint16, np.uint32, np.uint64):
    _FAMILY[np.dtype(_t)] = "uint"
_FAMILY[np.dtype(np.float16)] = "half"
for _t in (np.float32, np.float64):
    _FAMILY[np.dtype(_t)] = "float"
for _t in (np.complex64, np.complex128):
    _FAMILY[np.dtype(_t)] = "complex"
if bfloat16 is not None:
    _FAMILY[bfloat16] = "half"

MOVE_AS: dict[np.dtype, np.dtype | None] = {dt: None for dt in _FAMILY}
MOVE_AS[np.dtype(np.bool_)] = np.dtype(np.uint8)
MOVE_AS[np.dtype(np.float16)] = np.dtype(np.uint16)
if bfloat16 is not None:
    MOVE_AS[bfloat16] = np.dtype(np.uint16)

SUPPORTED_DTYPES = tuple(_FAMILY)
_SUPPORTED_NAMES = ", ".join(dt.name for dt in SUPPORTED_DTYPES)


def family(dtype: np.dtype) -> str:
    return _FAMILY[dtype]


def _check_dtype(a: np.ndarray, op: str, arg: str, group) -> None:
    if a.dtype not in _FAMILY:
        hint = " (install ml_dtypes for bfloat16)" if a.dtype.name == "bfloat16" else ""
        raise located(TypeError, op, f"{arg} has unsupported dtype {a.dtype}; "
                      f"expected one of {_SUPPORTED_NAMES}{hint}", group)


def _not_array(x, op: str, arg: str, group) -> TypeError:
    what = type(x).__name__
    hint = " (wrap it with numpy.asarray)" if isinstance(x, (list, tuple, int, float, complex)) else ""
    return located(TypeError, op, f"{arg} must be a numpy array (or a torch CPU tensor), got "
                   f"{what}{hint}", group)


def _torch_cpu_view(x, op: str, arg: str, group) -> np.ndarray:
    """A numpy array sharing a torch CPU tensor's memory, so results land in the tensor."""
    if x.device.type != "cpu":
        raise located(TypeError, op, f"{arg} is a torch tensor on {x.device}; this build of spmd "
                      "moves host arrays only", group)
    t = x.detach()
    if str(t.dtype) == "torch.bfloat16":
        if bfloat16 is None:
            raise located(TypeError, op, f"{arg} is a bfloat16 tensor: install ml_dtypes", group)
        return t.view(_torch_int16()).numpy().view(bfloat16)
    return t.numpy()


def _torch_int16():
    import torch

    return torch.int16


def _host_array(x, op: str, arg: str, group) -> np.ndarray:
    """The slow path of the checks: subclasses of ndarray, torch CPU tensors."""
    if isinstance(x, _ndarray):
        return x
    if type(x).__module__.startswith("torch") and hasattr(x, "device"):
        return _torch_cpu_view(x, op, arg, group)
    raise _not_array(x, op, arg, group)


def array_in(x, op: str, arg: str, group) -> np.ndarray:
    """Check an array the operation only reads."""
    if type(x) is not _ndarray:
        x = _host_array(x, op, arg, group)
    if x.dtype not in _FAMILY:
        _check_dtype(x, op, arg, group)
    return x


def array_out(x, op: str, arg: str, group) -> np.ndarray:
    """Check an array the operation writes."""
    if type(x) is not _ndarray:
        x = _host_array(x, op, arg, group)
    if x.dtype not in _FAMILY:
        _check_dtype(x, op, arg, group)
    if not x.flags.writeable:
        raise located(ValueError, op, f"{arg} is read-only; the result is written into it", group)
    return x


def array_list(xs, op: str, arg: str, group, length: int | None, out: bool) -> list:
    """Check a list of arrays (and its length when the op fixes it)."""
    if not isinstance(xs, (list, tuple)):
        raise located(TypeError, op, f"{arg} must be a list of numpy arrays, got {type(xs).__name__}", group)
    if length is not None and len(xs) != length:
        raise located(ValueError, op, f"{arg} has {len(xs)} arrays, expected {length} (the group size)", group)
    check = array_out if out else array_in
    return [check(x, op, f"{arg}[{i}]", group) for i, x in enumerate(xs)]


def same_dtype(arrays: list, ref: np.ndarray, op: str, arg: str, ref_arg: str, group) -> None:
    for i, a in enumerate(arrays):
        if a.dtype != ref.dtype:
            raise located(TypeError, op, f"{arg}[{i}] has dtype {a.dtype}, expected {ref.dtype} "
                          f"(the dtype of {ref_arg})", group)


def same_size(arrays: list, ref: np.ndarray, op: str, arg: str, ref_arg: str, group) -> None:
    for i, a in enumerate(arrays):
        if a.size != ref.size:
            raise located(ValueError, op, f"{arg}[{i}] has {a.size} elements, expected {ref.size} "
                          f"(the size of {ref_arg})", group)


def movable(a: np.ndarray) -> np.ndarray:
    """The array as MPI should move it (a view; bool/float16/bfloat16 as unsigned ints)."""
    view = MOVE_AS[a.dtype]
    return a if view is None else a.view(view)


def contiguous(a: np.ndarray) -> np.ndarray:
    """``a`` itself when C-contiguous, else a contiguous copy."""
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def byte_view(a: np.ndarray) -> np.ndarray:
    """A contiguous array's bytes as a flat uint8 array (no copy)."""
    return a.reshape(-1).view(np.uint8)
