"""The host route of a call, decided once, in Python, as data.

Which MPI call a host array takes is a question of its dtype and reduce op, and of its
size against the shared-memory engine's thresholds.  The answers are made here, once
per process, and every engine reads them instead of deciding again:

- ``REDUCED[op name][dtype]``: the ``Route`` of each pair MPI reduces itself (the view
  MPI is handed the array as, the MPI op, and both as handles).  A pair missing from
  it goes through the MPI engine's staged path (an upcast, an average, a pre-scaled
  sum) or is refused; ``spmd.backends.reduction.PLANS`` says how, or why.
- ``MOVED[dtype]``: the ``Route`` of each dtype MPI moves (broadcast, gathers,
  exchanges, send and receive).
- ``SUMMED[dtype]``: the name of the compiled kernel that adds a dtype in a fused
  all-reduce of the shared-memory engine.
- per group, the shared-memory engine's ``Thresholds`` (spmd/backends/shm/thresholds.py):
  from which size it takes each op; and ``fuses``: whether an all_reduce_coalesced runs
  as one fused all-reduce of that engine.

The MPI engine reads ``REDUCED`` for its direct path; the host dispatcher and the
shared-memory engine read the thresholds and ``fuses``; the compiled call path gets the
same tables, by name, at ``bind()`` and ``set_thresholds()`` (fastcall.py) and only
looks calls up in them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from spmd.backends.mpi.packing import get_bucket_bytes
from spmd.backends.reduction import PLANS, ReductionPlan
from spmd.core.dtypes import MOVE_AS
from spmd.core.ops import ReduceOp

__all__ = ["Route", "REDUCED", "MOVED", "SUMMED", "reduced_route", "reduced_by_op", "fuses", "handle"]


def handle(obj: Any) -> int:
    """The MPI handle of an mpi4py object as a signed integer of the handle's width
    (mpi4py answers MPICH's negative int handles as unsigned numbers)."""
    # mpi4py's handle helpers (_sizeof, _handleof, _typedict: its documented low-level
    # interface for code that hands MPI handles to C)
    bits = 8 * MPI._sizeof(obj)
    h = MPI._handleof(obj) & ((1 << bits) - 1)  # (mpi4py's, as above)
    return h - (1 << bits) if h >> (bits - 1) else h


def _type_handle(dtype: np.dtype) -> int:
    """The handle of the MPI datatype mpi4py sends an array of ``dtype`` as (it names
    the datatype by the buffer's format); KeyError for a format it does not map."""
    return handle(MPI._typedict[np.empty(1, dtype).data.format])  # (mpi4py's, as above)


class Route:
    """What MPI is handed for arrays of one dtype (and reduce op): the array viewed as
    ``view`` (None: as itself), reduced with ``mpi_op`` (None for a route that only
    moves data); ``type_handle`` and ``op_handle`` are the same two as MPI handles, for
    the compiled call path."""

    __slots__ = ("view", "mpi_op", "type_handle", "op_handle")

    def __init__(self, dtype: np.dtype, view: np.dtype | None, mpi_op: MPI.Op | None):
        self.view = view
        self.mpi_op = mpi_op
        self.type_handle = _type_handle(view or dtype)
        self.op_handle = 0 if mpi_op is None else handle(mpi_op)

    def __repr__(self) -> str:
        return f"Route(view={self.view}, mpi_op={self.mpi_op})"


def _reduced() -> dict[str, dict[np.dtype, Route]]:
    table: dict[str, dict[np.dtype, Route]] = {}
    for name, plans in PLANS.items():
        routes = {}
        for dt, plan in plans.items():
            if type(plan) is ReductionPlan and plan.simple:
                try:
                    routes[dt] = Route(dt, plan.view, plan.mpi_op)
                except KeyError:   # a format mpi4py does not map: the staged path
                    pass
        if routes:
            table[name] = routes
    return table


def _moved() -> dict[np.dtype, Route]:
    table = {}
    for dt, view in MOVE_AS.items():
        try:
            table[dt] = Route(dt, view, None)
        except KeyError:   # a format mpi4py does not map: the Python path moves it
            pass
    return table


def _summed() -> dict[np.dtype, str]:
    """float32 and float64 by their own kernels; integers of each width added as
    unsigned ones (the bits of numpy's wrap-around)."""
    ints = (np.byte, np.ubyte, np.short, np.ushort, np.intc, np.uintc, np.int_, np.uint,
            np.longlong, np.ulonglong)
    kernels: dict[np.dtype, str] = {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64"}
    for t in ints:
        kernels[np.dtype(t)] = f"uint{8 * np.dtype(t).itemsize}"
    return kernels


REDUCED: dict[str, dict[np.dtype, Route]] = _reduced()
MOVED: dict[np.dtype, Route] = _moved()
SUMMED: dict[np.dtype, str] = _summed()


def reduced_route(dtype: np.dtype, op: Any) -> Route | None:
    """The route of ``dtype`` reduced with ``op`` where MPI reduces it itself, else None
    (also for an ``op`` that is not a ReduceOp: the checked path says what is wrong)."""
    try:
        return REDUCED[op.name].get(dtype)
    except (KeyError, AttributeError):
        return None


def reduced_by_op() -> dict[ReduceOp, dict[np.dtype, Route]]:
    """``REDUCED`` keyed by the ReduceOp members themselves (the compiled path compares
    a call's op by identity)."""
    return {getattr(ReduceOp, name): routes for name, routes in REDUCED.items()}


def fuses(tensors: list, op: Any, shm_from: int) -> bool:
    """True if all_reduce_coalesced of ``tensors`` runs as one all-reduce of the
    shared-memory engine: two or more arrays of one dtype MPI reduces itself with
    ``op``, one fusion bucket together of ``shm_from`` bytes (the engine's all_reduce
    threshold) or more.  The compiled path applies the same rule to the same tables, so
    ranks taking either path meet in the same call."""
    if len(tensors) < 2:
        return False
    dt = tensors[0].dtype
    if any(t.dtype is not dt for t in tensors):
        return False
    if reduced_route(dt, op) is None:
        return False
    return shm_from <= sum(t.nbytes for t in tensors) <= get_bucket_bytes()
