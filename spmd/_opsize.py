"""Message sizes and bus bandwidth as nccl-tests defines them.

Shared by ``spmd bench``, the comms logger and traces, so the three report the same
numbers for the same call.  The size of an operation is the largest buffer one rank
holds: the array of an all-reduce, broadcast, reduce or send; the gathered output of
an all-gather; the input of a reduce-scatter or an all-to-all.  ``algbw = size / time``
and ``busbw = algbw * bus_factor(op, n)``, which makes busbw comparable across ops and
group sizes: it is the bandwidth each rank's link would need for the op to take that
long with the best algorithm.
"""

from __future__ import annotations

import numpy as np

__all__ = ["bus_factor", "work_bytes", "P2P_OPS"]

_ndarray = np.ndarray
P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})

_ALL_REDUCE = frozenset({"all_reduce", "all_reduce_coalesced"})
_ONE_OF_N = frozenset({"all_gather", "all_gather_into_tensor", "all_gather_coalesced",
                       "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
                       "all_to_all_single", "gather", "scatter"})
# Ops whose outputs hold one n-th of the size (each rank keeps its share).
_SHARE_OUTPUT = frozenset({"reduce_scatter", "reduce_scatter_tensor", "scatter"})


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for ``op`` on ``n`` ranks (nccl-tests' formulas)."""
    if op in _ALL_REDUCE:
        return 2.0 * (n - 1) / n
    if op in _ONE_OF_N:
        return (n - 1) / n
    return 1.0


def _nbytes(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return int(getattr(x, "nbytes", 0) or 0)


def work_bytes(work) -> int:
    """The size of the operation a Work runs (call it before the Work completes)."""
    op = work._op
    outputs = work._outputs
    if outputs and len(outputs) == 1 and type(outputs[0]) is _ndarray:  # most ops
        size = outputs[0].nbytes
        return size * work._group._size if op in _SHARE_OUTPUT else size
    size = _nbytes(outputs) if outputs else 0
    if size == 0 and work._keep is not None:
        # gather on a non-root rank: only the buffer it sends is known
        size = _nbytes(work._keep) * (work._group._size if op == "gather" else 1)
    elif op in _SHARE_OUTPUT:
        size *= work._group._size
    return size
