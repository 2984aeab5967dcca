"""What drives the shared-memory engine's ops: each started op is a task (a generator of
steps, each yielding what the next one waits for), queued per group and run oldest
first; its Work runs the queue when tested or waited on.

A step waits either for every peer of the node to publish a step count (an int, read in
the window) or for an MPI request (the cross-node part of a hierarchical all_reduce).
While one group's task waits, the other groups' queues get their turn, so a rank waiting
here does not stall peers that wait for it in another group's op (as MPI progresses
every request in any call).
"""

from __future__ import annotations

import threading
from collections import deque

from spmd.backends.shm.window import NodeWindow, nap
from spmd.core import wait as _wait
from spmd.core.context import GroupContext
from spmd.core.errors import GroupBrokenError
from spmd.core.timeouts import to_seconds
from spmd.core.work import Work

__all__ = ["Scheduler", "ShmWork", "Task"]

_busy: set[Scheduler] = set()  # schedulers with tasks in their queues


class Task:
    """One started engine op: its steps (a generator) and what it waits for next."""

    __slots__ = ("done", "scheduler", "steps", "wait")

    def __init__(self, scheduler: Scheduler, steps) -> None:
        self.scheduler = scheduler
        self.steps = steps
        self.wait = None      # a step count every peer must reach, or an MPI request
        self.done = False


class ShmWork(Work):
    """A Work with no MPI request: testing it runs the queued steps.

    ``wait`` drives the steps through ``Work._poll`` (deadline, diagnosis, backing off
    when ranks outnumber cores), then lets ``Work.wait`` complete it.
    """

    __slots__ = ("_task",)

    engine = "shared memory"

    def __init__(self, task: Task, op: str, group: GroupContext, outputs, keep=None):
        self._task = task
        super().__init__(op, group, outputs, keep=keep)

    def _test(self) -> bool:
        task = self._task
        return task.done or task.scheduler.progress(task)

    def wait(self, timeout=None) -> bool:
        if not self._done and not self._test():
            self._poll(self.group.timeout if timeout is None else to_seconds(timeout, "Work.wait"))
        return super().wait(timeout)


class Scheduler:
    """One group's queue of tasks."""

    __slots__ = ("failed", "group", "_lock", "_queue", "window")

    def __init__(self, group: GroupContext) -> None:
        self.group = group
        self.window: NodeWindow | None = None    # set once the engine has made it
        self.failed: BaseException | None = None  # an error that left a step half done
        self._queue: deque[Task] = deque()
        # Threads may wait on ops of different groups at once, and a wait also runs the
        # other groups' steps: one thread at a time runs a queue's steps.
        self._lock = threading.Lock()

    def check(self, op: str) -> None:
        """Raise if an earlier op failed halfway: peers may wait for a step never published."""
        if self.failed is not None:
            raise GroupBrokenError(f"{op}: the shared-memory engine of group "
                                   f"{self.group.name} failed earlier: {self.failed!r} "
                                   f"[rank {self.group.rank}]")

    def start(self, steps, op: str, outputs, keep) -> ShmWork:
        """Queue an op's ``steps``, run what can run now, and return its Work."""
        task = Task(self, steps)
        self._queue.append(task)
        _busy.add(self)
        work = ShmWork(task, op, self.group, outputs, keep)
        self.progress(task)
        return work

    def clear(self) -> None:
        self._queue.clear()
        _busy.discard(self)

    def progress(self, task: Task) -> bool:
        """Run queued steps until one must wait; True once ``task`` is done.  While
        ``task`` waits, the other groups' queues get their turn too."""
        if not self._advance() and len(_busy) > 1 and not task.done:
            for other in list(_busy):
                if other is not self:
                    other._advance()
        return task.done

    def _advance(self) -> bool:
        """Run this queue's steps, oldest op first; False when one must wait (or when
        another thread is running them)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._run()
        finally:
            self._lock.release()

    def _run(self) -> bool:
        queue = self._queue
        while queue:
            head = queue[0]
            wait = head.wait
            if wait is not None:
                if type(wait) is int:
                    win = self.window
                    assert win is not None  # int waits come from steps on the window
                    if not win.reached(wait):
                        return False
                elif not wait.Test():
                    if _wait.yields:
                        nap()  # as the window's waits do: let the peers have the core
                    return False
            try:
                head.wait = next(head.steps)
            except StopIteration:
                head.done = True
                queue.popleft()
            except BaseException as exc:
                # Peers may be waiting for a step this rank will never publish.
                self.failed = exc
                head.done = True
                queue.popleft()
                _busy.discard(self)
                raise
        _busy.discard(self)
        return True
