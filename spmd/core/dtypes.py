"""The dtypes spmd moves, and how MPI sees each of them."""

from __future__ import annotations

import numpy as np

__all__ = ["SUPPORTED_DTYPES", "SUPPORTED_NAMES", "FAMILY", "MOVE_AS", "bfloat16", "family"]

try:  # bfloat16 is optional: numpy has no native one
    from ml_dtypes import bfloat16 as _bf16

    bfloat16 = np.dtype(_bf16)
except ImportError:  # pragma: no cover - depends on the environment
    bfloat16 = None

# dtype -> (family, dtype MPI moves it as).  MPI has no bool, float16 or bfloat16 it
# is guaranteed to know, so those travel as unsigned integers of the same width.
FAMILY: dict[np.dtype, str] = {np.dtype(np.bool_): "bool"}
_t: type[np.generic]
for _t in (np.int8, np.int16, np.int32, np.int64):
    FAMILY[np.dtype(_t)] = "int"
for _t in (np.uint8, np.uint16, np.uint32, np.uint64):
    FAMILY[np.dtype(_t)] = "uint"
FAMILY[np.dtype(np.float16)] = "half"
for _t in (np.float32, np.float64):
    FAMILY[np.dtype(_t)] = "float"
for _t in (np.complex64, np.complex128):
    FAMILY[np.dtype(_t)] = "complex"
if bfloat16 is not None:
    FAMILY[bfloat16] = "half"

MOVE_AS: dict[np.dtype, np.dtype | None] = {dt: None for dt in FAMILY}
MOVE_AS[np.dtype(np.bool_)] = np.dtype(np.uint8)
MOVE_AS[np.dtype(np.float16)] = np.dtype(np.uint16)
if bfloat16 is not None:
    MOVE_AS[bfloat16] = np.dtype(np.uint16)

SUPPORTED_DTYPES = tuple(FAMILY)
SUPPORTED_NAMES = ", ".join(dt.name for dt in SUPPORTED_DTYPES)


def family(dtype: np.dtype) -> str:
    return FAMILY[dtype]
