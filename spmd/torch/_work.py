"""torch Work objects over spmd Works, and the thread that completes their futures.

DDP's C++ reducer waits on a Work's *future* and never calls ``wait()``; MPI only
progresses inside MPI calls.  So a Work whose future was asked for is handed to a
poller thread that tests it (MPI_THREAD_MULTIPLE, spmd's default) until it completes
and then completes the future, running its callbacks on that thread, as gloo runs
them on its own.  ``wait()`` goes through spmd's wait, so a timeout ends in spmd's
diagnosed DistTimeoutError.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import spmd
from spmd.core.timeouts import to_seconds
from spmd.core.wait import timeout_error
from spmd.torch._errors import as_torch_error

__all__ = ["FutureWork", "SpmdWork"]

_monotonic = time.monotonic


def _seconds(timeout) -> float | None:
    """Seconds of a wait timeout; None for none (c10d's kNoTimeout is 0 ms, and a negative
    one is its kUnsetTimeout: the group's)."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds <= 0:
        return None
    return to_seconds(seconds, "Work.wait")


class SpmdWork(dist.Work):
    """The handle torch gets for an operation on an spmd process group.

    It completes when all its spmd Works have completed and its ``finish`` step (a
    copy back into the caller's tensors, where one was needed) has run.  The future's
    value is the op's output tensors.
    """

    # The spmd Work of a receive from any source, which tells the sender (set by the
    # process group's recv_anysource; absent on every other Work).
    _src_work: spmd.Work | None

    def __init__(self, works: list, outputs, op: str, group: spmd.ProcessGroup, finish=None,
                 timeout: float | None = None):
        super().__init__()
        self._works: Sequence[Any] = works  # emptied (a tuple) once done
        self._outputs = outputs
        self._op = op
        self._group = group       # the spmd ProcessGroup
        self._finish = finish
        self._timeout = timeout   # the op's own timeout (options.timeout), seconds
        self._lock = threading.Lock()
        self._done = False
        self._exc: BaseException | None = None
        self._future: torch.futures.Future[Any] | None = None
        self._source: torch.futures.Future[Any] | None = None   # what completes _future
        self._started = _monotonic()   # for the poller: when its timeout runs out

    @property
    def outputs(self):
        """The op's output tensors (its future's value; what a coalesced Work collects)."""
        return self._outputs

    def _run_finish(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()

    def _settle(self, exc: BaseException | None) -> None:
        """Mark done (under the lock), then complete the future outside any lock."""
        # spmd's errors leave as torch's (DistBackendError...): spmd.torch._errors
        self._exc = exc if exc is None else as_torch_error(exc)
        self._done = True
        self._works = ()

    def _fire(self) -> None:
        source = self._source
        if source is None or source.done():
            return
        source.set_result(self._outputs if self._exc is None else self._exc)

    def wait(self, timeout=None) -> bool:
        """Block until the operation completes; return True.

        Args:
            timeout: a timedelta (or seconds); the op's or its group's timeout if None.

        Raises:
            spmd.DistTimeoutError: it did not complete in time (naming the ranks that
                did not get there).
        """
        if not self._done:
            seconds = _seconds(timeout)
            if seconds is None:
                seconds = self._timeout
            with self._lock:
                if not self._done:
                    deadline = None if seconds is None else _monotonic() + seconds
                    try:
                        for w in self._works:
                            left = None if deadline is None else \
                                max(deadline - _monotonic(), 1e-3)
                            w.wait(left)
                        self._run_finish()
                    except BaseException as exc:  # noqa: BLE001 - kept for exception()
                        self._settle(exc)
                    else:
                        self._settle(None)
            self._fire()
        if self._exc is not None:
            raise self._exc
        return True

    def _expire_if_late(self) -> None:
        """For the poller: past its timeout (the op's, else its group's) nobody may be
        waiting but its future (DDP's reducer waits in C++): end it as a waiting rank
        would, with the timeout's diagnosis, so the future fails instead of never
        completing."""
        if self._done:
            return
        limit = self._timeout if self._timeout is not None else \
            self._group.context.timeout
        if _monotonic() - self._started <= limit:
            return
        error = timeout_error(self._op, self._group.context, limit)   # with its diagnosis
        with self._lock:
            if self._done:
                return
            self._settle(error)
        self._fire()

    def _poll(self) -> bool:
        """Test once without blocking (skipped while another thread holds the Work)."""
        if self._done:
            return True
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._done:
                return True
            try:
                if not all(w.is_completed() for w in self._works):
                    return False
                for w in self._works:
                    if w.exception() is not None:
                        raise w.exception()
                self._run_finish()
            except BaseException as exc:  # noqa: BLE001 - kept for wait()/exception()
                self._settle(exc)
            else:
                self._settle(None)
        finally:
            self._lock.release()
        self._fire()
        return True

    def is_completed(self) -> bool:
        """True once the operation has completed (or failed); never blocks."""
        return self._poll()

    def is_success(self) -> bool:
        """True once the operation has completed without error."""
        return self._poll() and self._exc is None

    def exception(self):
        """The error the operation ended with, or None."""
        return self._exc

    def result(self) -> list:
        """The output tensors (waits first)."""
        self.wait()
        return list(self._outputs) if self._outputs is not None else []

    def synchronize(self) -> None:
        """Block until the operation completes (host tensors: same as wait)."""
        self.wait()

    def source_rank(self) -> int:
        """For a receive from any source: the sender's rank in the group (waits first)."""
        self.wait()
        src = getattr(self, "_src_work", None)
        if src is None:
            raise RuntimeError(f"{self._op}: source_rank() is only defined for receives from "
                               "any source")
        return spmd.get_group_rank(self._group, src.source_rank())

    _source_rank = source_rank  # what torch's recv(src=None) calls

    def get_future(self) -> torch.futures.Future:
        """A future completed with the output tensors when the operation completes,
        also when nobody waits on this Work (a poller thread watches it)."""
        if self._future is None:
            # The future handed out is a callback's of the one this Work completes: a
            # callback that raises sets a C++ error on it, which torch's C++ consumers
            # (DDP's reducer) see.  Future.set_exception only stores the exception as the
            # value, which DDP's reducer read as a result and crashed on.
            source: torch.futures.Future[Any] = torch.futures.Future(devices=self._devices())
            fut = source.then(_result_or_raise)
            with self._lock:
                self._source, self._future = source, fut
            if self._done:
                self._fire()
            else:
                _poller.add(self)
        return self._future

    def _devices(self) -> list:
        outs = self._outputs if isinstance(self._outputs, list) else []
        flat = [t for o in outs for t in (o if isinstance(o, list) else [o])]
        return sorted({str(t.device) for t in flat if isinstance(t, torch.Tensor)
                       and t.device.type == "cuda"})

    def __repr__(self) -> str:
        state = "completed" if self._done else "pending"
        return f"<SpmdWork {self._op} {state} group={self._group.name}>"


def _result_or_raise(source: torch.futures.Future) -> Any:
    """The callback between a Work's completion and its future: the outputs, or raise
    the Work's error (see ``SpmdWork.get_future``)."""
    value = source.value()
    if isinstance(value, BaseException):
        raise value
    return value


class _Poller:
    """One daemon thread per process testing the Works whose futures were asked for.

    It sleeps on a condition while nothing is pending; while something is, it tests
    every pending Work and backs off from 10 us to 200 us between rounds in which
    nothing completed, so a long collective costs little CPU.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: list[SpmdWork] = []
        self._thread: threading.Thread | None = None
        self._stopped = False

    def add(self, work: SpmdWork) -> None:
        with self._cond:
            if self._stopped:
                return
            self._pending.append(work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="spmd-torch-poller",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)

    def _run(self) -> None:
        idle = 0
        while True:
            with self._cond:
                while not self._pending and not self._stopped:
                    self._cond.wait()
                    idle = 0
                if self._stopped:
                    return
                works = list(self._pending)
            done = [w for w in works if w._poll()]
            for w in works:
                if not w._done:
                    w._expire_if_late()
            done += [w for w in works if w._done and w not in done]
            if done:
                with self._cond:
                    self._pending = [w for w in self._pending if not w._done]
                idle = 0
            else:
                idle = min(idle + 1, 5)
                time.sleep(1e-5 * (1 << idle) if idle < 5 else 2e-4)


_poller = _Poller()
atexit.register(_poller.stop)  # before mpi4py finalises MPI (atexit runs in reverse)


class FutureWork:
    """An spmd Future (what spmd's coalesced all-gather returns) seen as a Work."""

    def __init__(self, fut):
        self._fut = fut

    def wait(self, timeout=None) -> bool:
        self._fut.wait()
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def exception(self):
        # the spmd Future's error, without polling its producer (done() would)
        return self._fut._exc if self._fut._done else None
