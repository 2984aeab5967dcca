"""NCCL's dtype and reduce-op tables and unique-id forms: host-only facts, readable and
testable without CuPy or a GPU."""

from __future__ import annotations

import numpy as np

from ..arrays import SUPPORTED_DTYPES, family

__all__ = ["NCCL_TYPES", "NOCOLOR", "PLANS", "REDUCE_NAMES", "USE_MPI", "NcclPlan", "plan_for",
           "uid_for_cupy", "uid_to_bytes"]

# dtype name -> NCCL datatype.  bool travels as uint8 (0/1), complex as pairs of reals.
NCCL_TYPES = {
    "bool": "NCCL_UINT8", "int8": "NCCL_INT8", "uint8": "NCCL_UINT8",
    "int32": "NCCL_INT32", "uint32": "NCCL_UINT32", "int64": "NCCL_INT64",
    "uint64": "NCCL_UINT64", "float16": "NCCL_FLOAT16", "bfloat16": "NCCL_BFLOAT16",
    "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
    "complex64": "NCCL_FLOAT32", "complex128": "NCCL_FLOAT64",
}
_NCCL_OPS = {"SUM": "NCCL_SUM", "PRODUCT": "NCCL_PROD", "MIN": "NCCL_MIN", "MAX": "NCCL_MAX"}
# bool as 0/1 bytes: sum, max and or are a max; product, min and and are a min.
_BOOL_OPS = {"SUM": "NCCL_MAX", "MAX": "NCCL_MAX", "BOR": "NCCL_MAX",
             "PRODUCT": "NCCL_MIN", "MIN": "NCCL_MIN", "BAND": "NCCL_MIN"}
_BITWISE = ("BAND", "BOR", "BXOR")
USE_MPI = "use the MPI backend for them (backend='cpu:mpi,cuda:mpi')"
REDUCE_NAMES = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM")


class NcclPlan:
    """How one (dtype, ReduceOp) pair is reduced by NCCL."""

    __slots__ = ("avg", "count_factor", "nccl_op", "nccl_type", "premul")

    def __init__(self, nccl_type, nccl_op, count_factor=1, avg=None, premul=False):
        self.nccl_type = nccl_type        # NCCL datatype name
        self.nccl_op = nccl_op            # NCCL reduction name
        self.count_factor = count_factor  # 2 for complex (pairs of reals)
        self.avg = avg                    # None, or how to divide the sum: float/int/uint
        self.premul = premul              # scale a copy of the input by the factor first

    def __repr__(self) -> str:
        return (f"NcclPlan({self.nccl_type}, {self.nccl_op}, x{self.count_factor}, "
                f"avg={self.avg}, premul={self.premul})")


def plan_for(dtype: np.dtype, name: str) -> NcclPlan | str:
    """The plan, or the reason NCCL refuses the pair (one sentence)."""
    fam = family(dtype)
    ntype = NCCL_TYPES.get(dtype.name)
    if fam == "bool":
        if name in _BOOL_OPS:
            return NcclPlan(ntype, _BOOL_OPS[name])
        if name == "BXOR":
            return f"NCCL has no bitwise reductions (ReduceOp.BXOR); {USE_MPI}"
        return f"ReduceOp.{name} is not defined for bool arrays"
    if name in _BITWISE:
        if fam in ("int", "uint"):
            return f"NCCL has no bitwise reductions (ReduceOp.{name}); {USE_MPI}"
        return f"ReduceOp.{name} needs an integer or bool dtype, got {dtype}"
    if ntype is None:
        return f"NCCL has no {dtype} type to reduce; {USE_MPI}"
    if fam in ("int", "uint"):
        if name in _NCCL_OPS:
            return NcclPlan(ntype, _NCCL_OPS[name])
        if name == "AVG":  # sum, then truncate toward zero on the device (as MPI's does)
            return NcclPlan(ntype, "NCCL_SUM", avg=fam)
        return f"ReduceOp.{name} needs a floating point or complex dtype, got {dtype}"
    count = 2 if fam == "complex" else 1
    if fam == "complex" and name not in ("SUM", "AVG", "PREMUL_SUM"):
        return (f"NCCL reduces complex arrays as pairs of reals: ReduceOp.{name} is not "
                f"available for {dtype} (SUM, AVG and PREMUL_SUM are)")
    if name == "AVG":
        return NcclPlan(ntype, "NCCL_SUM", count, avg="float")
    if name == "PREMUL_SUM":
        return NcclPlan(ntype, "NCCL_SUM", count, premul=True)
    return NcclPlan(ntype, _NCCL_OPS[name], count)


PLANS: dict[str, dict[np.dtype, NcclPlan | str]] = {
    name: {dt: plan_for(dt, name) for dt in SUPPORTED_DTYPES} for name in REDUCE_NAMES
}


def uid_to_bytes(uid) -> bytes:
    """NCCL's unique id as 128 bytes: CuPy 14 returns bytes, CuPy 13 a tuple of chars."""
    if isinstance(uid, (bytes, bytearray)):
        return bytes(uid)
    return bytes(int(v) & 0xFF for v in uid)


def uid_for_cupy(raw: bytes, cupy_version: str):
    """The id in the form ``NcclCommunicator`` takes: bytes on CuPy >= 14, a tuple of
    signed chars before."""
    major = int(cupy_version.split(".")[0])
    if major >= 14:
        return bytes(raw)
    return tuple(b - 256 if b > 127 else b for b in raw)


NOCOLOR = -1  # NCCL_SPLIT_NOCOLOR
