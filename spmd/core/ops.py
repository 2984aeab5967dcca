"""Reduction operators: ``ReduceOp`` and the pre-multiplied sum."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from spmd.core.typing import Array

Factor = complex | np.number | Array

__all__ = ["ReduceOp", "RedOpType", "make_premul_sum"]


class ReduceOp:
    """A reduction operator for ``all_reduce``, ``reduce`` and ``reduce_scatter``.

    The members mirror ``torch.distributed.ReduceOp``: ``SUM``, ``PRODUCT``, ``MIN``,
    ``MAX``, ``BAND``, ``BOR``, ``BXOR``, ``AVG`` and ``PREMUL_SUM``.  ``PREMUL_SUM``
    needs a factor and is made with :func:`make_premul_sum` (torch's
    ``_make_nccl_premul_sum``): every rank's input is multiplied by the factor before
    the sum.

    Semantics by dtype (checked before anything is sent):

    - bool: SUM and MAX are logical or, PRODUCT and MIN logical and, BXOR logical xor;
      AVG and PREMUL_SUM raise TypeError.
    - integers: every op; AVG divides the sum by the group size and truncates toward
      zero (what NCCL does); PREMUL_SUM raises TypeError.
    - floating point: SUM, PRODUCT, MIN, MAX, AVG, PREMUL_SUM; bitwise ops raise
      TypeError.  float16 and bfloat16 are reduced in float32 and rounded once.
    - complex: SUM, PRODUCT, AVG, PREMUL_SUM; MIN, MAX and bitwise ops raise TypeError.
    """

    __slots__ = ("name", "factor")

    SUM: ReduceOp
    PRODUCT: ReduceOp
    MIN: ReduceOp
    MAX: ReduceOp
    BAND: ReduceOp
    BOR: ReduceOp
    BXOR: ReduceOp
    AVG: ReduceOp
    PREMUL_SUM: ReduceOp
    UNUSED: ReduceOp
    RedOpType: type[ReduceOp]

    def __init__(self, name: str, factor: Factor | None = None):
        self.name = name
        self.factor: Any = factor  # PREMUL_SUM's: a scalar or a one-element array

    def __repr__(self) -> str:
        if self.factor is not None:
            return f"ReduceOp.{self.name}(factor={self.factor!r})"
        return f"ReduceOp.{self.name}"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ReduceOp):
            return self.name == other.name and self.factor is other.factor
        if isinstance(other, str):
            return self.name == other.upper()
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)

    def __reduce__(self) -> tuple[Any, ...]:
        if self.factor is None:
            return (getattr, (ReduceOp, self.name))
        return (make_premul_sum, (self.factor,))


_NAMES = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM", "UNUSED")
for _name in _NAMES:
    setattr(ReduceOp, _name, ReduceOp(_name))
ReduceOp.RedOpType = ReduceOp  # torch spells the members ReduceOp.RedOpType.SUM too
RedOpType = ReduceOp


def make_premul_sum(factor: Factor) -> ReduceOp:
    """Return a PREMUL_SUM op that multiplies every input by ``factor`` before summing.

    Args:
        factor: a real or complex Python/numpy scalar, or a one-element array.

    Raises:
        TypeError: the factor is not a number or a one-element array.
    """
    value = factor
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        if getattr(value, "size", None) != 1:
            raise TypeError(
                f"make_premul_sum: factor must be a scalar or a one-element array, "
                f"got an array of shape {tuple(value.shape)}"
            )
    elif isinstance(value, bool) or not isinstance(value, numbers.Number):
        raise TypeError(f"make_premul_sum: factor must be a number, got {type(value).__name__}")
    return ReduceOp("PREMUL_SUM", factor=factor)
