"""The shared-memory engine's records: a started op's task, its Work, and a chunk of a
two-shot all-reduce between its reduction and its copy-out."""

from __future__ import annotations

from spmd.core.work import Work, seconds_of

__all__ = ["Chunk", "ShmWork", "Task"]


class Task:
    """One started engine op: its steps (a generator) and what it waits for next."""

    __slots__ = ("done", "engine", "steps", "wait")

    def __init__(self, engine, steps):
        self.engine = engine
        self.steps = steps
        self.wait = None      # a step count every peer must reach, or an MPI request
        self.done = False


class ShmWork(Work):
    """A Work with no MPI request: testing it runs the engine's next steps.

    ``wait`` drives the steps through ``Work._poll`` (deadline, diagnosis, backing off
    when ranks outnumber cores), then lets ``Work.wait`` complete it.
    """

    __slots__ = ("_task",)

    engine = "shared memory"

    def __init__(self, task: Task, op: str, group, outputs, keep=None):
        self._task = task
        super().__init__([], op, group, outputs, keep=keep)

    def _test(self) -> bool:
        task = self._task
        return task.done or task.engine.progress(task)

    def wait(self, timeout=None) -> bool:
        if not self._done and not self._test():
            self._poll(self._group._timeout if timeout is None else seconds_of(timeout))
        return super().wait(timeout)


class Chunk:
    """One chunk of a two-shot all-reduce between its reduction and its copy-out."""

    __slots__ = ("lo", "cuts", "slot", "acc", "dst", "request")

    def __init__(self, lo: int, cuts: list[int], slot: int, acc, dst, request):
        self.lo = lo            # its first item in the flat array
        self.cuts = cuts        # where each local rank's part starts
        self.slot = slot        # the slot it went through
        self.acc = acc          # this rank's reduced part (the accumulator)
        self.dst = dst          # this rank's part of the slot, where the result goes
        self.request = request  # the cross-node all-reduce of ``acc``, or None
