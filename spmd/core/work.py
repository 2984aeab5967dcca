"""Work: the handle of a started operation, whatever engine runs it.

Each engine's Work says how to test its operation (``_test``): MPI requests
(:class:`spmd.backends.mpi.work.MPIWork`), the shared-memory engine's steps, an NCCL end
event.  What every Work does alike lives here: the wait under the group's timeout
through the one wait helper, the finish step, the observers, the Future.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from spmd.core.context import GroupContext
from spmd.core.futures import Future
from spmd.core.timeouts import to_seconds
from spmd.core.wait import wait_until

__all__ = ["Work"]

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

    A wait under the group's timeout (``wait()``, and every blocking call) that ends
    without the operation (the timeout, an interrupt, a dead peer, the group broken) gives
    the operation up (:meth:`_give_up`): the engine leaves it nothing to write into that
    the program may reuse, and the Work ends with that error.  ``wait(timeout)`` is a
    poll: past its timeout the operation stays this Work's, to be waited for again.
    """

    __slots__ = ("_finish", "outputs", "keep", "_done", "error", "_future",
                 "op", "group", "_meta", "flight_number", "_given_up", "__weakref__")

    engine = "?"          # what runs the operation, for diagnoses (each engine's Work says)
    device_end: tuple[Any, Any] | None = None  # (engine, end event) of an op that ends on a GPU stream

    def __init__(self, op: str, group: GroupContext, outputs: list | None = None,
                 *, finish: Callable[[], None] | None = None, keep: Any = None):
        self.op = op
        self.group = group
        self.outputs = outputs
        self._finish = finish
        self.keep = keep          # buffers the operation is reading or writing
        self._done = False
        self.error: BaseException | None = None
        self._future: Future | None = None
        self._meta = None          # for observers: whatever they attach to this Work
        self._given_up = False
        if observers:
            for obs in observers:
                obs.started(self)

    def _test(self) -> bool:
        """Whether the operation has completed; never blocks (each engine's Work says how)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how to test {self.op}")

    def _complete(self) -> None:
        finish = self._finish
        if finish is not None:
            try:
                finish()
            except Exception as exc:  # noqa: BLE001 - reported through wait()/exception()
                self.error = exc
        self._ended()

    def _ended(self) -> None:
        """The Work is over (completed, or given up with ``error``): tell the observers
        and the Future, and let go of the buffers."""
        self._done = True
        self._finish = None
        self.keep = None
        if observers:
            for obs in observers:
                obs.completed(self)
        if self._future is not None:
            if self.error is None:
                self._future.set_result(self.outputs)
            else:
                self._future.set_exception(self.error)

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until the operation completes; return True.

        Args:
            timeout: how long to wait (timedelta or seconds); the group's timeout if None.

        Raises:
            DistTimeoutError: the operation did not complete in time.
        """
        seconds = None if timeout is None else to_seconds(timeout, f"{self.op}: Work.wait")
        if not self._done:
            if not self._test():
                if seconds is None:
                    self._wait_or_give_up()
                else:
                    self._poll(seconds)
            if self._finish is None and not observers and self._future is None:
                self._done = True  # _complete() with nothing to run
                self.keep = None
            else:
                self._complete()
        if self.error is not None:
            raise self.error
        return True

    def _poll(self, seconds: float, give_up: Callable[[], bool] | None = None) -> None:
        """Wait until ``_test()`` passes, ``seconds`` at most; past them ``give_up()`` runs
        first where given, and a True from it ends the wait as if the test had passed."""
        wait_until(self._test, seconds, self.op, self.group, work=self, on_timeout=give_up)

    def _wait_or_give_up(self) -> None:
        """Wait under the group's timeout; an error or interrupt that ends the wait first
        gives the operation up, and the Work ends with it."""
        try:
            self._poll(self.group.timeout, self._give_up_once)
        except BaseException as exc:
            if self._give_up_once():   # delivered after all: its results are in place
                self._complete()
                raise
            self._end_with(exc)
            if self._leaves_running():
                # The peers may still be in the op, or reach it later: out of step, the
                # group can take no more ops (a timed-out collective broke it already).
                self.group.mark_broken(f"{self.op} was given up on rank {self.group.rank} "
                                       f"({type(exc).__name__}) with its MPI operation "
                                       "still running")
            raise

    def _give_up_once(self) -> bool:
        if self._given_up:
            return False
        self._given_up = True
        return self._give_up()

    def _give_up(self) -> bool:
        """Stop waiting for the operation, leaving it nothing to write into that the
        program may reuse (each engine's Work says how; by default the operation writes
        into the program's arrays only inside the wait).  True if it completed after all."""
        return False

    def _leaves_running(self) -> bool:
        """Whether the given-up operation is still running (held until it completes)."""
        return False

    def _end_with(self, exc: BaseException) -> None:
        """The operation was given up: the Work ends with ``exc``, its results unfinished."""
        self.error = exc
        self._ended()

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
        return self.is_completed() and self.error is None

    def exception(self) -> BaseException | None:
        """Return the error the operation ended with, or None."""
        return self.error

    def result(self) -> list:
        """Return the operation's output arrays (waiting for it first)."""
        self.wait()
        return self.outputs if self.outputs is not None else []

    def source_rank(self) -> int:
        """For a receive: the global rank of the sender (waits first)."""
        raise RuntimeError(f"{self.op}: source_rank() is only defined for receives")

    def get_future(self) -> Future:
        """Return a Future completed with the output arrays when this Work completes."""
        if self._future is None:
            self._future = Future.driven_by(self.wait, self.is_completed)
            if self._done:
                if self.error is None:
                    self._future.set_result(self.outputs)
                else:
                    self._future.set_exception(self.error)
        return self._future

    def __repr__(self) -> str:
        state = "completed" if self._done else "pending"
        return f"<Work {self.op} {state} group={self.group.name}>"


