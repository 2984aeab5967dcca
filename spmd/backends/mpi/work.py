"""MPIWork: a Work whose operation is one or more nonblocking MPI requests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from spmd.backends.mpi.faults import failure
from spmd.core.context import GroupContext
from spmd.core.flight_recorder import MPI_ENGINE
from spmd.core.wait import wait_until
from spmd.core.work import Work

__all__ = ["MPIWork"]

_testall = MPI.Request.Testall


class MPIWork(Work):
    """The Work of nonblocking MPI requests (``status``: a receive's, for its sender)."""

    __slots__ = ("_reqs", "_status")

    engine = MPI_ENGINE

    def __init__(self, reqs: list, op: str, group: GroupContext, outputs: list | None = None,
                 *, finish: Callable[[], None] | None = None, keep: Any = None,
                 status: MPI.Status | None = None):
        self._reqs = reqs
        self._status = status
        super().__init__(op, group, outputs, finish=finish, keep=keep)

    def _test(self) -> bool:
        reqs = self._reqs
        try:
            if len(reqs) == 1:  # most ops: Test skips Testall's list conversion
                return reqs[0].Test(self._status)
            return _testall(reqs)
        except MPI.Exception as exc:   # a dead rank (ULFM) becomes the group's failure
            raise failure(exc, self.op, self.group) from None

    def _poll(self, seconds: float) -> None:
        reqs = self._reqs
        test = reqs[0].Test if len(reqs) == 1 and self._status is None else self._test
        try:
            wait_until(test, seconds, self.op, self.group, work=self)
        except MPI.Exception as exc:
            raise failure(exc, self.op, self.group) from None

    def source_rank(self) -> int:
        """For a receive: the global rank of the sender (waits first)."""
        if self._status is None:
            raise RuntimeError(f"{self.op}: source_rank() is only defined for receives")
        self.wait()
        return self.group.global_rank(self._status.Get_source())
