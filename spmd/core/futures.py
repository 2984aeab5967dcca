"""Futures: the value side of a Work, and helpers to wait on many of them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["Future", "collect_all", "wait_all"]


class Future:
    """The result of an asynchronous operation, like ``torch.futures.Future``.

    A Future made by :meth:`spmd.Work.get_future` completes when its Work completes;
    its value is the list of output arrays.  MPI makes progress only inside MPI
    calls, so completion is noticed when some thread waits or polls (``wait()``,
    ``done()``, ``Work.is_completed()``); callbacks run on that thread.
    """

    __slots__ = ("_done", "_value", "_exc", "_callbacks", "_wait_fn", "_poll_fn")

    def __init__(self) -> None:
        self._done = False
        self._value: Any = None
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[[Future], None]] = []
        # How to drive the producer when somebody waits on or polls this future; a
        # Future() made by the user is completed by set_result() and has neither.
        self._wait_fn: Callable[[], object] | None = None
        self._poll_fn: Callable[[], object] | None = None

    @classmethod
    def driven_by(cls, wait_fn: Callable[[], object], poll_fn: Callable[[], object]) -> Future:
        """A future completed by its producer: ``wait_fn`` blocks until the producer is
        done, ``poll_fn`` tests it once (both complete the future through set_result)."""
        fut = cls()
        fut._wait_fn = wait_fn
        fut._poll_fn = poll_fn
        return fut

    def done(self) -> bool:
        """Return True if the value (or an error) is set; polls the producer once."""
        if not self._done and self._poll_fn is not None:
            try:
                self._poll_fn()
            except Exception:  # noqa: BLE001 - the error is stored on this future
                pass
        return self._done

    def wait(self) -> Any:
        """Block until the future completes and return its value (or raise its error)."""
        if not self._done:
            if self._wait_fn is None:
                raise RuntimeError("Future.wait: nothing will ever complete this future; "
                                   "call set_result() or set_exception() first")
            try:
                self._wait_fn()
            except Exception as exc:  # noqa: BLE001
                if not self._done:
                    self.set_exception(exc)
        return self.value()

    def value(self) -> Any:
        """Return the value of a completed future; raise its error if it failed."""
        if not self._done:
            raise RuntimeError("Future.value: the future has not completed; call wait() first")
        if self._exc is not None:
            raise self._exc
        return self._value

    def set_result(self, result: Any) -> None:
        """Complete the future with ``result`` and run its callbacks."""
        if self._done:
            raise RuntimeError("Future.set_result: the future is already completed")
        self._value = result
        self._finish()

    def set_exception(self, exc: BaseException) -> None:
        """Complete the future with an error and run its callbacks."""
        if self._done:
            raise RuntimeError("Future.set_exception: the future is already completed")
        self._exc = exc
        self._finish()

    def _finish(self) -> None:
        self._done = True
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def add_done_callback(self, callback: Callable[[Future], None]) -> None:
        """Run ``callback(self)`` when the future completes (at once if it has)."""
        if self._done:
            callback(self)
        else:
            self._callbacks.append(callback)

    def then(self, callback: Callable[[Future], Any]) -> Future:
        """Return a new future completed with ``callback(self)`` once this one completes.

        An exception raised by the callback becomes the new future's error.
        """
        child = Future.driven_by(self.wait, self.done)

        def run(parent: Future) -> None:
            try:
                child.set_result(callback(parent))
            except Exception as exc:  # noqa: BLE001
                child.set_exception(exc)

        self.add_done_callback(run)
        return child


def collect_all(futures: Iterable[Future]) -> Future:
    """Return a future that completes, with the list of ``futures``, when all have."""
    futs = list(futures)
    for f in futs:
        if not isinstance(f, Future):
            raise TypeError(f"collect_all: expected Future objects, got {type(f).__name__}")

    def wait_each() -> None:
        for f in futs:
            try:
                f.wait()
            except Exception:  # noqa: BLE001 - each future keeps its own error
                pass

    result = Future.driven_by(wait_each, lambda: all(f.done() for f in futs))
    remaining = [len(futs)]

    def one_done(_: Future) -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            result.set_result(futs)

    if not futs:
        result.set_result(futs)
    for f in futs:
        f.add_done_callback(one_done)
    return result


def wait_all(futures: Iterable[Future]) -> list[Any]:
    """Wait for every future and return their values; raise the first error found."""
    futs = list(futures)
    collect_all(futs).wait()
    return [f.value() for f in futs]
