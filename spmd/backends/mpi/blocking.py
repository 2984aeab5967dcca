"""Blocking calls on host arrays without a Work: the short path of the common case.

A blocking op on contiguous numpy arrays with a plain reduce op, below the
shared-memory engine's thresholds, needs nothing a Work is for: no finish step, no
staging buffer, nothing to keep alive after the call returns.  Each method here starts
the MPI request, records the op in the flight recorder (the entry a hang diagnosis
reads), tests it once and, if it has not completed, waits through the one wait helper
with the group's timeout, which ends in the same diagnosis as a Work's wait.

Every method returns False, having done nothing, for a call outside that case (a
staged dtype or op, a view, a read-only output, a size the shared-memory engine takes,
a Work observer other than the flight recorder); the caller then takes the ordinary
path, which also raises the errors for bad input.  A call taken here is one the
ordinary path accepts and runs on the same MPI call, so results are the same.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from spmd.backends.reduction import simple_plan
from spmd.core.context import GroupContext
from spmd.core.dtypes import MOVE_AS
from spmd.core.flight_recorder import recorder
from spmd.core.wait import wait_until
from spmd.core.work import observers

__all__ = ["BlockingHost"]

_IN_PLACE = MPI.IN_PLACE
# What MOVE_AS.get answers for a dtype spmd does not move (a dtype no array gets).
_NOT_MOVED = np.dtype([("not moved", np.uint8)])


def _as(x: np.ndarray, view: np.dtype | None) -> np.ndarray:
    """``x`` as MPI moves it: itself, or reinterpreted as ``view`` (bool as uint8...)."""
    return x if view is None else x.view(view)


def _contiguous_pair(out: np.ndarray, a: np.ndarray) -> bool:
    """Input and output contiguous, the output writeable."""
    return a.flags.c_contiguous and out.flags.c_contiguous and out.flags.writeable


class BlockingHost:
    """The short blocking path of one group's host engine (``HostEngine.blocking``)."""

    __slots__ = ("group", "comm", "shm", "_n")

    def __init__(self, group: GroupContext, comm: MPI.Intracomm, shm: Any):
        self.group = group
        self.comm = comm
        self.shm = shm          # the shared-memory engine, or None
        self._n = group.size

    def _run(self, req: MPI.Request, op: str, a: np.ndarray | None) -> None:
        """Record, test, wait: the blocking op's whole life after its request started."""
        g = self.group
        n = recorder.begin(op, g, a) if observers else None
        if not req.Test():
            e = None if n is None else recorder.entry(n)
            if e is None:
                wait_until(req.Test, g.timeout, op, g)
            else:
                wait_until(req.Test, g.timeout, op, g, seq=e.seq, kind=e.kind,
                           on_timeout=lambda: recorder.mark_timed_out(e.number))
        if n is not None:
            recorder.end(n)

    @staticmethod
    def _declines() -> bool:
        # Observers other than the recorder (comms log, timelines) need a Work.
        return bool(observers) and (len(observers) != 1 or observers[0] is not recorder)

    def all_reduce(self, a: np.ndarray, op: Any) -> bool:
        plan = simple_plan(a.dtype, op)
        flags = a.flags
        if plan is None or not flags.c_contiguous or not flags.writeable or self._declines():
            return False
        if self.shm is not None and a.nbytes >= self.shm.all_reduce_from:
            return False
        req = self.comm.Iallreduce(_IN_PLACE, _as(a, plan.view), plan.mpi_op)
        self._run(req, "all_reduce", a)
        return True

    def reduce(self, a: np.ndarray, root: int, op: Any, is_root: bool) -> bool:
        plan = simple_plan(a.dtype, op)
        flags = a.flags
        if plan is None or not flags.c_contiguous \
                or (is_root and not flags.writeable) or self._declines():
            return False
        if self.shm is not None and a.nbytes >= self.shm.reduce_from:
            return False
        m = _as(a, plan.view)
        if is_root:
            req = self.comm.Ireduce(_IN_PLACE, m, plan.mpi_op, root)
        else:
            req = self.comm.Ireduce(m, None, plan.mpi_op, root)
        self._run(req, "reduce", a)
        return True

    def broadcast(self, a: np.ndarray, root: int) -> bool:
        view = MOVE_AS.get(a.dtype, _NOT_MOVED)
        flags = a.flags
        if view is _NOT_MOVED or not flags.c_contiguous or not flags.writeable \
                or self._declines():
            return False
        if self.shm is not None and a.nbytes >= self.shm.broadcast_from:
            return False
        self._run(self.comm.Ibcast(_as(a, view), root), "broadcast", a)
        return True

    def all_gather_into_tensor(self, out: np.ndarray, a: np.ndarray) -> bool:
        view = MOVE_AS.get(a.dtype, _NOT_MOVED)
        if view is _NOT_MOVED or out.dtype != a.dtype or out.size != self._n * a.size \
                or not _contiguous_pair(out, a) or self._declines():
            return False
        if self.shm is not None and self.shm.gathers(out.nbytes):
            return False
        self._run(self.comm.Iallgather(_as(a, view), _as(out, view)), "all_gather_into_tensor",
                  out)
        return True

    def reduce_scatter_tensor(self, out: np.ndarray, a: np.ndarray, op: Any) -> bool:
        plan = simple_plan(a.dtype, op)
        if plan is None or out.dtype != a.dtype \
                or a.size != self._n * out.size or not _contiguous_pair(out, a) \
                or self._declines():
            return False
        if self.shm is not None and a.nbytes >= self.shm.reduce_scatter_from:
            return False
        req = self.comm.Ireduce_scatter_block(_as(a, plan.view), _as(out, plan.view),
                                              plan.mpi_op)
        self._run(req, "reduce_scatter_tensor", out)
        return True

    def all_to_all_single(self, out: np.ndarray, a: np.ndarray) -> bool:
        """Equal splits only: the same shape in and out, its first dimension a multiple
        of the group size."""
        view = MOVE_AS.get(a.dtype, _NOT_MOVED)
        shape = a.shape
        if view is _NOT_MOVED or out.dtype != a.dtype or out.shape != shape or not shape \
                or shape[0] % self._n or not _contiguous_pair(out, a) or self._declines():
            return False
        self._run(self.comm.Ialltoall(_as(a, view), _as(out, view)), "all_to_all_single", out)
        return True

    def barrier(self) -> bool:
        if self._declines():
            return False
        self._run(self.comm.Ibarrier(), "barrier", None)
        return True

    def send(self, a: np.ndarray, peer: int, tag: int) -> bool:
        view = MOVE_AS.get(a.dtype, _NOT_MOVED)
        if view is _NOT_MOVED or not a.flags.c_contiguous or self._declines():
            return False
        self._run(self.comm.Isend(_as(a, view), peer, tag), "send", a)
        return True

    def recv(self, a: np.ndarray, peer: int, tag: int) -> bool:
        """From a given peer only (a receive from any source needs its status)."""
        view = MOVE_AS.get(a.dtype, _NOT_MOVED)
        flags = a.flags
        if view is _NOT_MOVED or not flags.c_contiguous or not flags.writeable \
                or self._declines():
            return False
        self._run(self.comm.Irecv(_as(a, view), peer, tag), "recv", a)
        return True
