"""Torch tensors as spmd arrays, and torch's reduce ops as spmd's.

CPU tensors become numpy arrays sharing their memory (no copy, strided views
included), so spmd's collectives write results straight into the tensors.  CUDA
tensors go to spmd as they are (spmd takes them through DLPack).  Dtypes numpy lacks
(bfloat16 through ml_dtypes; float8 and complex32 as integers of their width) can be
moved; only those spmd can reduce can be reduced.  Tensors with no dense memory of
their own (sparse, quantized, nested, meta) get spmd's error, naming what to move
instead.

The numpy views are made through DLPack, never ``Tensor.numpy()``: that marks the
tensor's storage not resizable for good, and FSDP1 frees its unsharded parameters by
resizing their storage to 0 after the all-gather.  A tensor handed to the backend
comes back changed in its values only.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

import spmd
from spmd.core.arrays import bfloat16 as _np_bf16
from spmd.core.arrays import tensor_as_numpy, tensor_without_dense_memory
from spmd.core.context import GroupContext
from spmd.core.errors import located

__all__ = ["host_in", "host_out", "reduce_op", "same_storage"]

# Dtypes numpy cannot hold: moved as unsigned integers of the same width.
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_LESS = {torch.complex32, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
               torch.float8_e5m2fnuz}
_bf16 = torch.bfloat16

def _view(t: torch.Tensor, op: str, arg: str, reduces: bool, group: GroupContext) -> np.ndarray:
    dtype = t.dtype
    if dtype is _bf16:
        if _np_bf16 is None:
            raise located(TypeError, op, f"{arg} is a bfloat16 tensor; install ml_dtypes "
                          "(pip install spmd[bf16]) to move it", group)
        return tensor_as_numpy(t, op, arg, group, torch.int16).view(_np_bf16)
    if dtype in _NUMPY_LESS:
        if reduces:
            raise located(TypeError, op, f"{arg} has dtype {dtype}, which spmd moves but "
                          "cannot reduce", group)
        return tensor_as_numpy(t, op, arg, group, _AS_INT[t.element_size()])
    return tensor_as_numpy(t, op, arg, group)


def _host_tensor(t, op: str, arg: str, group: GroupContext):
    """``t`` without autograd if it is a CPU tensor, None for a CUDA tensor."""
    if not isinstance(t, torch.Tensor):
        raise located(TypeError, op, f"{arg} must be a torch.Tensor, got {type(t).__name__}",
                      group)
    if not t.is_cpu:   # (10x cheaper than t.device.type)
        if t.is_cuda:
            return None
        why = tensor_without_dense_memory(t) or (
            f"is on device {t.device}; the spmd backend moves CPU tensors, and CUDA tensors "
            "where CuPy is installed")
        raise located(TypeError, op, f"{arg} {why}", group)
    return t.detach() if t.requires_grad else t


def host_in(t, op: str, arg: str, group: GroupContext, reduces: bool = False):
    """What spmd reads for tensor ``t``: a numpy view (CPU) or the tensor (CUDA).

    Raises:
        TypeError: ``t`` is no tensor, has no dense memory (sparse, quantized, nested,
            meta), or has a dtype spmd cannot reduce where ``reduces``.
    """
    cpu = _host_tensor(t, op, arg, group)
    if cpu is None:
        return t
    if cpu.is_conj() or cpu.is_neg():
        cpu = cpu.resolve_conj().resolve_neg()  # a lazy view: its values, materialised
    return _view(cpu, op, arg, reduces, group)


def host_out(t, op: str, arg: str, group: GroupContext, reduces: bool = False):
    """What spmd writes for tensor ``t``: a numpy view sharing its memory (CPU).

    Raises:
        TypeError: as :func:`host_in`, and for a lazy conjugate or negative view.
    """
    cpu = _host_tensor(t, op, arg, group)
    if cpu is None:
        return t
    if cpu.is_conj() or cpu.is_neg():
        raise located(TypeError, op, f"{arg} is a lazy conjugate/negative view; results "
                      "cannot be written into it (call resolve_conj()/resolve_neg() first)",
                      group)
    return _view(cpu, op, arg, reduces, group)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two tensors may overlap in memory (MPI forbids that between the
    buffers of one call: FSDP2's all-gather input is a view into its output)."""
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and \
            a.numel() > 0 and b.numel() > 0
    except (RuntimeError, NotImplementedError):  # tensors without storage
        return False


# Keyed by torch's RedOpType enum: hashing it is cheap, reading its ``.name`` is not
# (over a microsecond per call through pybind11).
_RED = dist.ReduceOp.RedOpType
_OPS = {getattr(_RED, name): getattr(spmd.ReduceOp, name) for name in
        ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")}


def reduce_op(op) -> spmd.ReduceOp:
    """spmd's ReduceOp for torch's ``ReduceOp`` or ``ReduceOp.RedOpType``."""
    kind = getattr(op, "op", op)
    if type(kind) is not _RED:   # (pybind11 enums compare equal to ints)
        raise ValueError(f"unsupported reduce op {op!r}")
    red = _OPS.get(kind)
    if red is not None:
        return red
    if kind == _RED.PREMUL_SUM:  # type: ignore[attr-defined]  # (missing from the stubs)
        factor = getattr(op, "factor", None)
        if factor is None:
            raise ValueError("PREMUL_SUM needs a factor: make it with "
                             "torch.distributed._make_nccl_premul_sum(factor); torch before "
                             "2.13 does not show the factor to Python backends")
        if isinstance(factor, torch.Tensor):
            factor = factor.detach().cpu().reshape(()).item()
        return spmd.make_premul_sum(factor)
    raise ValueError(f"unsupported reduce op {op!r}")
