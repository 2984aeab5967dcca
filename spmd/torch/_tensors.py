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

A small contiguous tensor's view is kept (:class:`_Views`) and handed out again while the
tensor keeps its memory, shape and dtype: making one costs more than a small
collective's own work.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
import torch.distributed as dist

import spmd
from spmd.core.arrays import bfloat16 as _np_bf16
from spmd.core.arrays import tensor_as_numpy, tensor_without_dense_memory
from spmd.core.context import GroupContext
from spmd.core.errors import located

__all__ = ["host_in", "host_out", "reduce_op", "same_storage", "views"]

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


class _Views:
    """The numpy views of small contiguous CPU tensors, made once per tensor.

    A view is the tensor's memory as it was when the view was made: it is handed out
    again only while the tensor still starts at the same address with the same shape,
    dtype and contiguity, which is what the view describes (a tensor that was resized,
    given other storage or another dtype gets a new view).  An entry goes when its tensor
    does.  Only tensors of up to ``MAX_BYTES`` are kept, at most ``MAX_ENTRIES`` of
    them: a tensor whose storage was swapped keeps its old storage alive until its
    next call, so what that can hold stays small; and a larger op costs more than a view.
    """

    MAX_BYTES = 64 * 1024
    MAX_ENTRIES = 1024

    def __init__(self) -> None:
        self._by_id: dict[int, tuple] = {}

    def get(self, t) -> np.ndarray | None:
        """The kept view of tensor ``t``, if it still describes ``t``'s memory."""
        entry = self._by_id.get(id(t))
        if entry is None:
            return None
        ref, ptr, shape, dtype, view = entry
        try:
            if ref() is t and t.data_ptr() == ptr and t.dtype is dtype and \
                    t.shape == shape and t.is_contiguous():
                return view
        except (RuntimeError, NotImplementedError):  # now without dense memory
            pass
        return None

    def get_pair(self, t, u) -> tuple[np.ndarray, np.ndarray] | None:
        """The kept views of tensors ``t`` and ``u`` (an op's output and input), if both
        still describe their tensors' memory and the two do not overlap (MPI forbids
        that between one call's buffers: the op's own path copies the input then); else
        None.  :meth:`get` for two tensors in one call (the ops that take the compiled
        path straight from torch count their Python frames)."""
        by_id = self._by_id
        found = []
        for x in (t, u):
            entry = by_id.get(id(x))
            if entry is None:
                return None
            ref, ptr, shape, dtype, view = entry
            try:
                if not (ref() is x and x.data_ptr() == ptr and x.dtype is dtype and
                        x.shape == shape and x.is_contiguous()):
                    return None
            except (RuntimeError, NotImplementedError):  # now without dense memory
                return None
            found.append((ptr, view))
        (p, a), (q, b) = found
        if p < q + b.nbytes and q < p + a.nbytes:
            return None
        return a, b

    def keeps(self, t) -> bool:
        """Whether a view of CPU tensor ``t`` is kept: ``t`` is small and contiguous, of
        a dtype numpy holds or bfloat16 (the dtypes moved as integers are refused by
        reducing ops: their view is made each time, so that refusal is never skipped)."""
        try:
            return t.nbytes <= self.MAX_BYTES and t.dtype not in _NUMPY_LESS and \
                t.is_contiguous()
        except (RuntimeError, NotImplementedError):  # no dense memory: the view says why
            return False

    def keep(self, t, view: np.ndarray) -> None:
        """Keep ``view`` of ``t`` (a tensor that :meth:`keeps` says yes to, without
        conjugate or negative bit).  The view must be made from an alias of ``t``
        (``t.detach()``), never from ``t`` itself: torch keeps a tensor's Python object
        alive while its C++ tensor is referenced, and the view references the tensor it
        was made from, so a view of ``t`` would keep ``t``, and its entry, forever."""
        by_id = self._by_id
        if len(by_id) >= self.MAX_ENTRIES:
            by_id.clear()
        key = id(t)

        def forget(ref, key=key, by_id=by_id) -> None:
            entry = by_id.get(key)
            if entry is not None and entry[0] is ref:
                del by_id[key]

        by_id[key] = (weakref.ref(t, forget), t.data_ptr(), t.shape, t.dtype, view)

    def __len__(self) -> int:
        return len(self._by_id)


views = _Views()


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
    a = views.get(t)
    if a is not None:
        return a
    cpu = _host_tensor(t, op, arg, group)
    if cpu is None:
        return t
    if cpu.is_conj() or cpu.is_neg():
        cpu = cpu.resolve_conj().resolve_neg()  # a lazy view: its values, materialised
        return _view(cpu, op, arg, reduces, group)
    return _kept(t, cpu, op, arg, reduces, group)


def host_out(t, op: str, arg: str, group: GroupContext, reduces: bool = False):
    """What spmd writes for tensor ``t``: a numpy view sharing its memory (CPU).

    Raises:
        TypeError: as :func:`host_in`, and for a lazy conjugate or negative view.
    """
    a = views.get(t)
    if a is not None:
        return a
    cpu = _host_tensor(t, op, arg, group)
    if cpu is None:
        return t
    if cpu.is_conj() or cpu.is_neg():
        raise located(TypeError, op, f"{arg} is a lazy conjugate/negative view; results "
                      "cannot be written into it (call resolve_conj()/resolve_neg() first)",
                      group)
    return _kept(t, cpu, op, arg, reduces, group)


def _kept(t, cpu, op: str, arg: str, reduces: bool, group: GroupContext) -> np.ndarray:
    """The view of ``cpu`` (``t`` as a CPU tensor without autograd), kept for ``t``'s
    next call where :class:`_Views` keeps it."""
    if not views.keeps(t):
        return _view(cpu, op, arg, reduces, group)
    view = _view(t.detach() if cpu is t else cpu, op, arg, reduces, group)
    views.keep(t, view)
    return view


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


_ReduceOp = dist.ReduceOp
_TORCH_SUM, _SPMD_SUM = _RED.SUM, spmd.ReduceOp.SUM  # type: ignore[attr-defined]


def reduce_op(op) -> spmd.ReduceOp:
    """spmd's ReduceOp for torch's ``ReduceOp`` or ``ReduceOp.RedOpType``."""
    if type(op) is _ReduceOp and op == _TORCH_SUM:   # the common case, without a hash
        return _SPMD_SUM
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
