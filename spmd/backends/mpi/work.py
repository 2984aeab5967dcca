"""MPIWork: a Work whose operation is one or more nonblocking MPI requests.

A given-up op (see :class:`spmd.core.work.Work`) and a Work the program dropped before
its op completed leave their requests to :mod:`spmd.backends.mpi.orphans`: a receive
given up is cancelled, anything else is held with its buffers until MPI is done, and a
group whose op was left running that way is broken, with its peers told.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from mpi4py import MPI

from spmd.backends.mpi import orphans
from spmd.backends.mpi.faults import failure
from spmd.core.context import GroupContext
from spmd.core.flight_recorder import MPI_ENGINE, recorder
from spmd.core.wait import wait_until
from spmd.core.work import Work

__all__ = ["MPIWork"]

_testall = MPI.Request.Testall


class MPIWork(Work):
    """The Work of nonblocking MPI requests (``status``: a receive's, for its sender)."""

    __slots__ = ("_reqs", "_status", "_left_running")

    engine = MPI_ENGINE

    def __init__(self, reqs: list, op: str, group: GroupContext, outputs: list | None = None,
                 *, finish: Callable[[], None] | None = None, keep: Any = None,
                 status: MPI.Status | None = None):
        self._reqs = reqs
        self._status = status
        self._left_running = False
        super().__init__(op, group, outputs, finish=finish, keep=keep)

    def _test(self) -> bool:
        reqs = self._reqs
        try:
            if len(reqs) == 1:  # most ops: Test skips Testall's list conversion
                return reqs[0].Test(self._status)
            return _testall(reqs)
        except MPI.Exception as exc:   # a dead rank (ULFM) becomes the group's failure
            raise failure(exc, self.op, self.group) from None

    def _poll(self, seconds: float, give_up: Callable[[], bool] | None = None) -> None:
        reqs = self._reqs
        test = reqs[0].Test if len(reqs) == 1 and self._status is None else self._test
        try:
            wait_until(test, seconds, self.op, self.group, work=self, on_timeout=give_up)
        except MPI.Exception as exc:
            raise failure(exc, self.op, self.group) from None

    def _give_up(self) -> bool:
        """A receive is cancelled; anything else is held with its buffers until MPI is
        done with them, and its group broken (the op left running puts the ranks out of
        step)."""
        reqs, self._reqs = self._reqs, []
        receive = self._status is not None   # a receive carries its status (the sender)
        if orphans.give_up(reqs, (self.keep, self.outputs), receive=receive):
            self._reqs = reqs   # completed: the finish step and source_rank() see it done
            return True
        self._left_running = not receive
        return False

    def _leaves_running(self) -> bool:
        return self._left_running

    def __del__(self) -> None:
        # A Work dropped before its op completed (an async op nobody waits for, a wait
        # that raised): MPI may still write into its arrays, so they must outlive it.
        reqs = self._reqs
        if reqs and not self._done and not MPI.Is_finalized():
            # The flight recorder's entry ends when MPI is done, as if it had been waited.
            number = getattr(self, "flight_number", None)
            then = None if number is None else partial(recorder.end, number)
            try:
                if not MPI.Request.Testall(reqs):
                    orphans.hold(reqs, (self.keep, self.outputs), then)
                elif then is not None:
                    then()
            except MPI.Exception:
                orphans.hold([r for r in reqs if r], (self.keep, self.outputs), then)

    def source_rank(self) -> int:
        """For a receive: the global rank of the sender (waits first)."""
        if self._status is None:
            raise RuntimeError(f"{self.op}: source_rank() is only defined for receives")
        self.wait()
        return self.group.global_rank(self._status.Get_source())
