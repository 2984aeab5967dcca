"""How the shared-memory engine reduces: the MPI backend's plans, as numpy calls in a
fixed order.

Same semantics as the MPI path (bool as uint8 0/1, float16/bfloat16 accumulated in
float32 and rounded once, PREMUL_SUM scaling each input in the accumulating dtype,
AVG dividing the sum once); MIN and MAX are numpy's, which propagate NaN.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from spmd.backends.reduction import AVERAGE, premul_factor

__all__ = ["Reduction", "accumulate", "finalize"]

_UFUNCS = ((MPI.SUM, np.add), (MPI.PROD, np.multiply), (MPI.MIN, np.minimum),
           (MPI.MAX, np.maximum), (MPI.BAND, np.bitwise_and), (MPI.BOR, np.bitwise_or),
           (MPI.BXOR, np.bitwise_xor))


class Reduction:
    """How the engine reduces: the MPI backend's plan for (op, dtype), as numpy calls."""

    __slots__ = ("avg", "direct", "factor", "mpi_op", "n", "ufunc", "upcast", "view")

    def __init__(self, plan, op, n: int):
        self.ufunc = next(u for m, u in _UFUNCS if m == plan.mpi_op)
        self.view = plan.view
        self.upcast = plan.upcast
        self.factor = premul_factor(op) if plan.premul else None
        self.avg = AVERAGE[plan.avg] if plan.avg else None
        self.n = n
        self.mpi_op = plan.mpi_op
        self.direct = plan.simple

    def scratch(self, count: int, storage: np.dtype):
        """(accumulator or None, temporary or None) for parts of up to ``count`` items."""
        acc = None if self.upcast is None else np.empty(count, self.upcast)
        tmp = None
        if self.upcast is not None or self.factor is not None:
            tmp = np.empty(count, self.upcast or storage)
        return acc, tmp


def accumulate(red: Reduction, acc, srcs: list, tmp) -> None:
    """``acc = srcs[0] op srcs[1] op ...`` in list order (each premultiplied for PREMUL_SUM)."""
    u = red.ufunc
    f = red.factor
    if red.upcast is None and f is None:
        if len(srcs) == 1:
            np.copyto(acc, srcs[0])
            return
        u(srcs[0], srcs[1], out=acc)
        for s in srcs[2:]:
            u(acc, s, out=acc)
        return
    np.copyto(acc, srcs[0], casting="unsafe")
    if f is not None:
        np.multiply(acc, f, out=acc, casting="unsafe")
    for s in srcs[1:]:
        if red.upcast is None:
            assert f is not None  # no upcast and no factor returned above
            np.multiply(s, f, out=tmp, casting="unsafe")
        else:
            # Widen first: a float16 product must be rounded in float32, as MPI's path does.
            np.copyto(tmp, s, casting="unsafe")
            if f is not None:
                np.multiply(tmp, f, out=tmp, casting="unsafe")
        u(acc, tmp, out=acc)


def finalize(red: Reduction, acc, dst) -> None:
    """Divide for AVG and round into ``dst`` (once, after the whole reduction)."""
    if red.avg is not None:
        red.avg(acc, red.n)
    if acc is not dst:
        np.copyto(dst, acc, casting="unsafe")
