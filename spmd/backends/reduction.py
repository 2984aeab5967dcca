"""Reduction rules shared by every engine: how each (ReduceOp, dtype) pair is reduced.

A plan is built once per pair: the MPI op, a view that lets MPI reduce it (bool as
uint8), an upcast (float16/bfloat16 reduced in float32 and rounded once), how AVG
divides (integers truncate toward zero, as NCCL does) and whether PREMUL_SUM scales the
input first.  Pairs that cannot be reduced hold the sentence that says why.  The MPI
engine, the shared-memory engine, the NCCL engine and persistent plans read them.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from spmd.core.context import GroupContext
from spmd.core.dtypes import SUPPORTED_DTYPES, family
from spmd.core.errors import located
from spmd.core.ops import ReduceOp

__all__ = ["ReductionPlan", "PLANS", "AVERAGE", "premul_factor", "checked_plan", "mpi_view",
           "counts_displs"]

_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)


class ReductionPlan:
    """How one (dtype, ReduceOp) pair is reduced by MPI."""

    __slots__ = ("mpi_op", "view", "upcast", "avg", "premul", "simple")

    def __init__(self, mpi_op, view=None, upcast=None, avg=None, premul=False):
        self.mpi_op = mpi_op
        self.view = view        # reinterpret as this dtype (bool as uint8), no copy
        self.upcast = upcast    # reduce a copy in this dtype (float16/bfloat16 in float32)
        self.avg = avg          # None, or how to divide the sum by the group size
        self.premul = premul    # scale a copy of the input by the op's factor first
        self.simple = upcast is None and avg is None and not premul


# The MPI op of each ReduceOp name MPI reduces itself (the others are composed: AVG,
# PREMUL_SUM).
MPI_OPS = {"SUM": MPI.SUM, "PRODUCT": MPI.PROD, "MIN": MPI.MIN, "MAX": MPI.MAX,
            "BAND": MPI.BAND, "BOR": MPI.BOR, "BXOR": MPI.BXOR}
_BITWISE = ("BAND", "BOR", "BXOR")
# bool arrays are reduced as uint8 0/1 values: sum and max are "or", product and min "and".
_BOOL_OPS = {"SUM": MPI.MAX, "PRODUCT": MPI.MIN, "MIN": MPI.MIN, "MAX": MPI.MAX,
             "BAND": MPI.BAND, "BOR": MPI.BOR, "BXOR": MPI.BXOR}


def _plan_for(dtype: np.dtype, name: str) -> ReductionPlan | str:
    """The plan, or the reason the pair is refused (one sentence)."""
    fam = family(dtype)
    if fam == "bool":
        if name in _BOOL_OPS:
            return ReductionPlan(_BOOL_OPS[name], view=_U8)
        return f"ReduceOp.{name} is not defined for bool arrays"
    if fam in ("int", "uint"):
        if name in MPI_OPS:
            return ReductionPlan(MPI_OPS[name])
        if name == "AVG":
            return ReductionPlan(MPI.SUM, avg=fam)
        return f"ReduceOp.{name} needs a floating point or complex dtype, got {dtype}"
    if name in _BITWISE:
        return f"ReduceOp.{name} needs an integer or bool dtype, got {dtype}"
    if fam == "complex" and name in ("MIN", "MAX"):
        return f"ReduceOp.{name} is not defined for complex arrays ({dtype})"
    upcast = _F32 if fam == "half" else None
    if name == "AVG":
        return ReductionPlan(MPI.SUM, upcast=upcast, avg="float")
    if name == "PREMUL_SUM":
        return ReductionPlan(MPI.SUM, upcast=upcast, premul=True)
    return ReductionPlan(MPI_OPS[name], upcast=upcast)


# Built once: plans by op name, then by dtype.  Refusals are stored as strings.
PLANS: dict[str, dict[np.dtype, ReductionPlan | str]] = {
    name: {dt: _plan_for(dt, name) for dt in SUPPORTED_DTYPES} for name in MPI_OPS
}
for _name in ("AVG", "PREMUL_SUM"):
    PLANS[_name] = {dt: _plan_for(dt, _name) for dt in SUPPORTED_DTYPES}


def _avg_float(buf, n):
    if buf.dtype.kind == "c":
        # numpy's complex / real is not correctly rounded; divide each component.
        buf.real /= n
        buf.imag /= n
    else:
        buf /= n


def _avg_uint(buf, n):
    buf //= n


def _avg_int(buf, n):
    # NCCL truncates toward zero; floor division rounds negative quotients down.
    # (Operators only: the NCCL engine divides cupy arrays with the same functions.)
    fix = (buf < 0) & (buf % n != 0)
    buf //= n
    buf += fix


# How AVG divides the sum by the group size, per dtype family: every engine's rule, for
# numpy and cupy arrays alike.
AVERAGE = {"float": _avg_float, "uint": _avg_uint, "int": _avg_int}


def premul_factor(op: ReduceOp):
    f = op.factor
    if hasattr(f, "shape"):
        f = f.reshape(()).item() if hasattr(f, "reshape") else f.item()
    return f


def checked_plan(plans: dict, dtype, op, opname: str, group: GroupContext):
    """``plans[op.name][dtype]`` (a backend's reduction plans), or the error that says
    why ``op`` cannot reduce ``dtype`` arrays (plans hold a message where it cannot)."""
    try:
        plan = plans[op.name][dtype]
    except (KeyError, AttributeError):
        if not isinstance(op, ReduceOp):
            raise located(TypeError, opname, f"op must be a ReduceOp, got {type(op).__name__}",
                          group) from None
        raise located(ValueError, opname, f"{op!r} cannot be used as a reduction",
                      group) from None
    if type(plan) is str:
        raise located(TypeError, opname, plan, group)
    if plan.premul:
        if op.factor is None:
            raise located(ValueError, opname, "PREMUL_SUM needs a factor: use "
                          "spmd.make_premul_sum(factor)", group)
        if isinstance(premul_factor(op), complex) and family(dtype) != "complex":
            raise located(TypeError, opname, f"a complex PREMUL_SUM factor cannot scale "
                          f"{dtype} arrays", group)
    return plan


def mpi_view(buf: np.ndarray, plan: ReductionPlan) -> np.ndarray:
    return buf if plan.view is None else buf.view(plan.view)


def counts_displs(counts: list[int]) -> tuple[list[int], list[int]]:
    displs, total = [], 0
    for c in counts:
        displs.append(total)
        total += c
    return counts, displs
