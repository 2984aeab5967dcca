"""How the NCCL engine hands an array to NCCL: the datatype and reduction for each dtype
and ReduceOp (or why NCCL cannot), and the units data movement counts in.  Host-only
facts, readable and testable without CuPy or a GPU."""

from __future__ import annotations

import numpy as np

from spmd.core.arrays import SUPPORTED_DTYPES, family

__all__ = ["AVG_BF16_VERSION", "INT_MAX", "NCCL_TYPES", "PLANS", "REDUCE_NAMES", "USE_MPI",
           "NcclPlan", "byte_units", "cupy_count_is_int", "plan_for", "runtime_plan",
           "runtime_version"]

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


# NCCL 2.10 brought ncclAvg and ncclBfloat16; CuPy defines both names whatever the
# libnccl it loads, so the runtime version decides.
AVG_BF16_VERSION = 21000


def runtime_plan(plan: NcclPlan, version: int) -> tuple[bool, str | None]:
    """(use NCCL's own AVG, why NCCL cannot reduce it) for ``plan`` on the libnccl of
    version code ``version``; without ncclAvg, AVG is a sum then a division."""
    if plan.nccl_type == "NCCL_BFLOAT16" and version < AVG_BF16_VERSION:
        return False, (f"the NCCL library loaded (version code {version}) has no "
                       f"bfloat16 (2.10 and later have); {USE_MPI}")
    return plan.avg == "float" and version >= AVG_BF16_VERSION, None


# NCCL datatypes that move N bytes as one element (data movement only: bits are bits).
_UNITS = ((8, "NCCL_UINT64"), (4, "NCCL_UINT32"), (2, "NCCL_FLOAT16"), (1, "NCCL_UINT8"))
INT_MAX = 2**31 - 1  # CuPy 13.0-13.3 take broadcast's count as a C int


def byte_units(nbytes: int, ptr: int) -> tuple[str, int]:
    """(NCCL datatype, count) moving ``nbytes`` at address ``ptr`` in the widest unit
    both divide, so counts stay small (CuPy < 13.4's broadcast overflows at 2**31)."""
    for width, name in _UNITS:
        if nbytes % width == 0 and ptr % width == 0:
            return name, nbytes // width
    raise AssertionError("unreachable: one byte divides everything")


def cupy_count_is_int(version: str) -> bool:
    """Whether this CuPy takes NCCL broadcast's count as a C int (13.0 to 13.3)."""
    parts = version.split(".")
    try:
        return (13, 0) <= (int(parts[0]), int(parts[1])) < (13, 4)
    except (IndexError, ValueError):
        return False


def runtime_version(nccl) -> int:
    """The version code of the NCCL library loaded (0 when it cannot say)."""
    try:
        return int(nccl.get_version())
    except Exception:  # noqa: BLE001
        return 0
