"""Work: the handle of a started operation, wrapping its nonblocking MPI requests."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from mpi4py import MPI

from spmd.core.context import GroupContext
from spmd.core.futures import Future
from spmd.core.timeouts import to_seconds
from spmd.core.wait import wait_until

__all__ = ["Work"]

_testall = MPI.Request.Testall


# Side paths (comms logger, flight recorder, watchdog) see every Work when it starts
# and when it completes.  With none registered the cost is one truth test per event.
# Changed only through add_observer/remove_observer; the blocking paths (Python and
# compiled) read it to know whether they may run without a Work.
observers: list = []


def add_observer(observer) -> None:
    """Register an object with ``started(work)`` and ``completed(work)`` methods."""
    if observer not in observers:
        observers.append(observer)


def remove_observer(observer) -> None:
    if observer in observers:
        observers.remove(observer)


def then(work: Work, fn: Callable[[], None]) -> None:
    """Run ``fn`` when ``work`` completes, after what it already runs then (unpacking a
    fused buffer into its arrays, say)."""
    prev = work._finish
    if prev is None:
        work._finish = fn
    else:
        def both():
            prev()
            fn()
        work._finish = both


class Work:
    """Handle of an operation started by an ``async_op=True`` call or ``isend``/``irecv``.

    The blocking form of every operation is the asynchronous one followed by
    ``wait()``.  The arrays the operation reads and writes are kept alive by the Work
    until it completes; results land in the caller's arrays when it completes.
    """

    __slots__ = ("_reqs", "_finish", "_outputs", "_keep", "_done", "_exc", "_future",
                 "_op", "_group", "_status", "_meta", "_fr_entry", "__weakref__")

    engine = "MPI"        # what runs the operation, for diagnoses
    _device_end: tuple[Any, Any] | None = None  # (engine, end event) of an operation that ends on a GPU stream

    def __init__(self, reqs: list, op: str, group: GroupContext, outputs: list | None = None,
                 *, finish: Callable[[], None] | None = None, keep: Any = None,
                 status: MPI.Status | None = None):
        self._reqs = reqs
        self._op = op
        self._group = group
        self._outputs = outputs
        self._finish = finish
        self._keep = keep          # buffers MPI is reading or writing
        self._status = status      # for receives: who sent it
        self._done = False
        self._exc: BaseException | None = None
        self._future: Future | None = None
        self._meta = None          # for observers: whatever they attach to this Work
        if observers:
            for obs in observers:
                obs.started(self)

    def _test(self) -> bool:
        reqs = self._reqs
        if len(reqs) == 1:  # most ops: Test skips Testall's list conversion
            return reqs[0].Test(self._status)
        return _testall(reqs)

    def _complete(self) -> None:
        self._done = True
        finish = self._finish
        if finish is not None:
            try:
                finish()
            except Exception as exc:  # noqa: BLE001 - reported through wait()/exception()
                self._exc = exc
        self._finish = None
        self._keep = None
        if observers:
            for obs in observers:
                obs.completed(self)
        if self._future is not None:
            if self._exc is None:
                self._future.set_result(self._outputs)
            else:
                self._future.set_exception(self._exc)

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until the operation completes; return True.

        Args:
            timeout: how long to wait (timedelta or seconds); the group's timeout if None.

        Raises:
            DistTimeoutError: the operation did not complete in time.
        """
        seconds = None if timeout is None else to_seconds(timeout, f"{self._op}: Work.wait")
        if not self._done:
            # Inlined _test(): this is every blocking call's path.
            reqs = self._reqs
            if not (reqs[0].Test(self._status) if len(reqs) == 1 else _testall(reqs)):
                self._poll(self._group.timeout if seconds is None else seconds)
            if self._finish is None and not observers and self._future is None:
                self._done = True  # _complete() with nothing to run
                self._keep = None
            else:
                self._complete()
        if self._exc is not None:
            raise self._exc
        return True

    def _poll(self, seconds: float) -> None:
        reqs = self._reqs
        test = reqs[0].Test if len(reqs) == 1 and self._status is None else self._test
        wait_until(test, seconds, self._op, self._group, work=self)

    def synchronize(self) -> None:
        """Block the host until the operation completes (same as ``wait`` for host arrays)."""
        self.wait()

    def is_completed(self) -> bool:
        """Return True if the operation has completed; never blocks."""
        if not self._done and self._test():
            self._complete()
        return self._done

    def is_success(self) -> bool:
        """Return True if the operation completed without error."""
        return self.is_completed() and self._exc is None

    def exception(self) -> BaseException | None:
        """Return the error the operation ended with, or None."""
        return self._exc

    def result(self) -> list:
        """Return the operation's output arrays (waiting for it first)."""
        self.wait()
        return self._outputs if self._outputs is not None else []

    def source_rank(self) -> int:
        """For a receive from any source: the global rank of the sender (waits first)."""
        if self._status is None:
            raise RuntimeError(f"{self._op}: source_rank() is only defined for receives")
        self.wait()
        return self._group.global_rank(self._status.Get_source())

    def get_future(self) -> Future:
        """Return a Future completed with the output arrays when this Work completes."""
        if self._future is None:
            self._future = Future._driven_by(self.wait, self.is_completed)
            if self._done:
                if self._exc is None:
                    self._future.set_result(self._outputs)
                else:
                    self._future.set_exception(self._exc)
        return self._future

    def __repr__(self) -> str:
        state = "completed" if self._done else "pending"
        return f"<Work {self._op} {state} group={self._group.name}>"


