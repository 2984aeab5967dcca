"""Array adapters and dtype tables: what spmd accepts and how MPI sees it."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from spmd.core import cuda
from spmd.core.context import GroupContext
from spmd.core.dtypes import FAMILY, MOVE_AS, SUPPORTED_DTYPES, SUPPORTED_NAMES, bfloat16, family
from spmd.core.errors import located

__all__ = ["SUPPORTED_DTYPES", "MOVE_AS", "bfloat16", "family", "common_device", "device_of",
           "tensor_as_numpy", "tensor_without_dense_memory"]

_ndarray = np.ndarray


def _check_dtype(a: np.ndarray, op: str, arg: str, group: GroupContext) -> None:
    if a.dtype not in FAMILY:
        hint = " (install ml_dtypes for bfloat16)" if a.dtype.name == "bfloat16" else ""
        raise located(TypeError, op, f"{arg} has unsupported dtype {a.dtype}; "
                      f"expected one of {SUPPORTED_NAMES}{hint}", group)


def _not_array(x, op: str, arg: str, group: GroupContext) -> TypeError:
    what = type(x).__name__
    hint = " (wrap it with numpy.asarray)" if isinstance(x, (list, tuple, int, float, complex)) else ""
    return located(TypeError, op, f"{arg} must be a numpy array (or a cupy array, a torch tensor, "
                   f"or an object exposing __cuda_array_interface__ or DLPack), got {what}{hint}",
                   group)


def tensor_without_dense_memory(t) -> str | None:
    """Why torch tensor ``t`` has no memory spmd can move (sparse and other layouts,
    quantized, nested, meta), with what to move instead; None for a dense tensor."""
    if t.is_nested:
        return ("is a nested tensor; move its components (t.unbind()) or, for the jagged "
                "layout, its values() and offsets()")
    layout = str(t.layout)
    if layout != "torch.strided":
        hint = "t.to_dense(), or its indices and values" if layout == "torch.sparse_coo" \
            else "t.to_dense()"
        return f"has layout {layout}; spmd moves dense (strided) tensors: move {hint}"
    if t.is_quantized:
        return (f"is a quantized tensor ({t.dtype}); move t.int_repr() with its "
                "quantization parameters, or t.dequantize()")
    if t.device.type == "meta":
        return ("is on the meta device, which holds no data; materialise it first "
                "(t.to_empty(device=...) and initialise it)")
    return None


class _Capsule:
    """A made DLPack capsule handed to ``numpy.from_dlpack`` (which asks for it by
    method).  The capsule keeps the tensor's memory alive as long as the numpy view."""

    __slots__ = ("capsule",)

    def __init__(self, capsule) -> None:
        self.capsule = capsule

    def __dlpack__(self, **_):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


# torch's C function behind Tensor.__dlpack__ (found at the first tensor: spmd does not
# import torch): a capsule in ~0.2 us, where the Python method costs ~1.4 us more for
# stream and device arguments a CPU tensor has no use for.  False: this torch lacks it.
_to_dlpack: Any = None


def tensor_as_numpy(t, op: str, arg: str, group: GroupContext, bits_as=None) -> np.ndarray:
    """A numpy array sharing dense CPU tensor ``t``'s memory (``bits_as``: a torch dtype
    of the same width to see the bits as, for dtypes numpy lacks).

    Through DLPack: ``Tensor.numpy()`` would mark the tensor's storage not resizable for
    good, and FSDP1 frees parameters by resizing their storage to 0.

    Raises:
        TypeError: ``t`` has no dense memory (sparse, quantized, nested, meta), in spmd's
            words.
    """
    global _to_dlpack
    try:
        src = t if bits_as is None else t.view(bits_as)
        if _to_dlpack is None:
            # torch's private _C: the versioned DLPack export, where torch has it
            _to_dlpack = getattr(sys.modules["torch"]._C, "_to_dlpack_versioned", False)
        if _to_dlpack is False:
            return np.from_dlpack(src)
        return np.from_dlpack(_Capsule(_to_dlpack(src)))
    except (RuntimeError, BufferError) as exc:  # only tensors without dense memory
        why = tensor_without_dense_memory(t)
        if why is None:
            raise
        raise located(TypeError, op, f"{arg} {why}", group) from exc


def _torch_cpu_view(x, op: str, arg: str, group: GroupContext) -> np.ndarray:
    """A numpy array sharing a torch CPU tensor's memory, so results land in the tensor."""
    t = x.detach()
    if str(t.dtype) == "torch.bfloat16":
        if bfloat16 is None:
            raise located(TypeError, op, f"{arg} is a bfloat16 tensor: install ml_dtypes", group)
        return tensor_as_numpy(t, op, arg, group, _torch_int16()).view(bfloat16)
    return tensor_as_numpy(t, op, arg, group)


def _torch_int16():
    import torch

    return torch.int16


# DLPack device types (dlpack.h): kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged.
_DLPACK_DEVICES = {1: "cpu", 2: "cuda", 3: "cpu", 13: "cuda"}


def device_of(x) -> str | None:
    """``"cpu"`` or ``"cuda"`` for an array (or a raw argument); None for a non-array.

    numpy arrays are answered by one type check; everything else is the slow path.
    """
    if type(x) is _ndarray:
        return "cpu"
    return _other_device(x)


def _other_device(x) -> str | None:
    if isinstance(x, _ndarray):
        return "cpu"
    module = type(x).__module__
    if module.startswith("torch") and hasattr(x, "device"):
        return x.device.type
    # (the type first: a class's __cuda_array_interface__ is usually a property that
    # builds a dict, numba's and the device double's among them)
    if module.startswith("cupy") or hasattr(type(x), "__cuda_array_interface__") or \
            hasattr(x, "__cuda_array_interface__"):
        return "cuda"
    dlpack_device = getattr(x, "__dlpack_device__", None)
    if dlpack_device is not None:
        try:
            kind = int(dlpack_device()[0])
        except Exception:  # noqa: BLE001 - a broken producer is not an array
            return None
        return _DLPACK_DEVICES.get(kind, f"dlpack device type {kind}")
    return None


def common_device(op: str, group: GroupContext, *named) -> str:
    """The device of every array in ``named`` (pairs of argument name and array or list
    of arrays); raw arguments are fine.  Non-arrays are skipped (their own checks report
    them).

    Raises:
        TypeError: host and device arrays are mixed in one call.
    """
    first = None  # (device, name, index) of the first array
    for name, value in named:
        items = enumerate(value) if isinstance(value, (list, tuple)) else ((None, value),)
        for i, x in items:
            dev = "cpu" if type(x) is _ndarray else _other_device(x)
            if dev is None:
                continue
            if first is None:
                first = (dev, name, i)
            elif dev != first[0]:
                raise located(TypeError, op, f"{_label(name, i)} is a {dev} array but "
                              f"{_label(first[1], first[2])} is a {first[0]} array; the arrays "
                              "of one call must all be on the host or all on the GPU", group)
    return "cpu" if first is None else first[0]


def _label(name: str, i: int | None) -> str:
    return name if i is None else f"{name}[{i}]"


def is_device_array(a) -> bool:
    """True for what the checks return for GPU arguments (cupy arrays)."""
    return type(a) is not _ndarray and not isinstance(a, _ndarray)


def _host_array(x, op: str, arg: str, group: GroupContext):
    """The slow path of the checks: subclasses of ndarray, torch tensors, cupy arrays,
    ``__cuda_array_interface__`` and DLPack objects.  Host arrays come back as numpy
    arrays sharing their memory, GPU arrays as cupy arrays sharing theirs."""
    if isinstance(x, _ndarray):
        return x
    dev = _other_device(x)
    if dev == "cpu":
        if type(x).__module__.startswith("torch"):
            return _torch_cpu_view(x, op, arg, group)
        try:
            return np.from_dlpack(x)
        except Exception as exc:  # noqa: BLE001
            raise located(TypeError, op, f"{arg}: numpy cannot import this DLPack object "
                          f"({exc})", group) from None
    if dev == "cuda":
        return cuda.as_device_array(x, op, arg, group)
    if dev is not None:
        why = tensor_without_dense_memory(x) if type(x).__module__.startswith("torch") else None
        raise located(TypeError, op, f"{arg} " + (why or f"is on {dev}; spmd moves host (cpu) "
                      "and CUDA arrays"), group)
    raise _not_array(x, op, arg, group)


def array_in(x, op: str, arg: str, group: GroupContext) -> tuple[Any, str]:
    """Check an array the operation only reads: the array as the engines take it (a
    numpy or cupy array) and its device ("cpu" or "cuda")."""
    if type(x) is not _ndarray:
        if type(x) is cuda.device_array_type:   # a cupy array: only its device to check
            x = cuda.on_bound_device(x, op, arg, group)
        else:
            x = _host_array(x, op, arg, group)
        if not isinstance(x, _ndarray):  # a GPU array
            if x.dtype not in FAMILY:
                _check_dtype(x, op, arg, group)
            return x, "cuda"
    if x.dtype not in FAMILY:
        _check_dtype(x, op, arg, group)
    return x, "cpu"


def array_out(x, op: str, arg: str, group: GroupContext) -> tuple[Any, str]:
    """Check an array the operation writes: the array as the engines take it (a numpy
    or cupy array) and its device ("cpu" or "cuda")."""
    if type(x) is not _ndarray:
        if type(x) is cuda.device_array_type:   # a cupy array: only its device to check
            x = cuda.on_bound_device(x, op, arg, group)
        else:
            x = _host_array(x, op, arg, group)
        if not isinstance(x, _ndarray):  # a GPU array (cupy has no writeable flag)
            if x.dtype not in FAMILY:
                _check_dtype(x, op, arg, group)
            return x, "cuda"
    if x.dtype not in FAMILY:
        _check_dtype(x, op, arg, group)
    if not x.flags.writeable:
        raise located(ValueError, op, f"{arg} is read-only; the result is written into it", group)
    return x, "cpu"


def array_list(xs, op: str, arg: str, group: GroupContext, length: int | None, out: bool) -> list:
    """Check a list of arrays (and its length when the op fixes it)."""
    if not isinstance(xs, (list, tuple)):
        raise located(TypeError, op, f"{arg} must be a list of numpy arrays, got {type(xs).__name__}", group)
    if length is not None and len(xs) != length:
        raise located(ValueError, op, f"{arg} has {len(xs)} arrays, expected {length} (the group size)", group)
    if out:  # the common case first: writeable numpy arrays of supported dtypes
        if all(type(x) is _ndarray and x.dtype in FAMILY and x.flags.writeable for x in xs):
            return list(xs)
        return [array_out(x, op, f"{arg}[{i}]", group)[0] for i, x in enumerate(xs)]
    if all(type(x) is _ndarray and x.dtype in FAMILY for x in xs):
        return list(xs)
    return [array_in(x, op, f"{arg}[{i}]", group)[0] for i, x in enumerate(xs)]


def same_dtype(arrays: list, ref: np.ndarray, op: str, arg: str, ref_arg: str, group: GroupContext) -> None:
    for i, a in enumerate(arrays):
        if a.dtype != ref.dtype:
            raise located(TypeError, op, f"{arg}[{i}] has dtype {a.dtype}, expected {ref.dtype} "
                          f"(the dtype of {ref_arg})", group)


def same_size(arrays: list, ref: np.ndarray, op: str, arg: str, ref_arg: str, group: GroupContext) -> None:
    for i, a in enumerate(arrays):
        if a.size != ref.size:
            raise located(ValueError, op, f"{arg}[{i}] has {a.size} elements, expected {ref.size} "
                          f"(the size of {ref_arg})", group)


def movable(a: np.ndarray) -> np.ndarray:
    """The array as MPI should move it (a view; bool/float16/bfloat16 as unsigned ints)."""
    view = MOVE_AS[a.dtype]
    return a if view is None else a.view(view)


def contiguous(a, xp: Any = np):
    """``a`` itself when C-contiguous, else a contiguous copy made by the array module
    ``xp`` (numpy, or cupy for device arrays: bfloat16 is copied as uint16, which every
    CuPy has kernels for)."""
    if a.flags.c_contiguous:
        return a
    if xp is not np and bfloat16 is not None and a.dtype == bfloat16:
        return xp.ascontiguousarray(a.view(np.uint16)).view(bfloat16)
    return xp.ascontiguousarray(a)

