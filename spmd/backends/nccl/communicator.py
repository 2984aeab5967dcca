"""A group's NCCL communicator: how it is created (a unique id over MPI, or
``ncclCommSplit`` of the parent's), the CUDA stream its operations run on, the Work of
an operation (its end event), the operations in flight, and the abort that ends them.

The engine (``engine.py``) says what to enqueue; this module owns when and where it runs:
``with communicator.launch(op) as (comm, stream_ptr):`` enqueues on the communicator's
stream after the caller's current stream, and ``communicator.started(...)`` returns the
operation's Work.  While this thread's ``communicator.caller.on`` is set (the engine's
blocking calls) a launch enqueues on the caller's current stream itself, as c10d's NCCL
backend does for ``async_op=False``: the caller's later work is ordered after it with no
event between two streams.

After a timeout the communicator is *held*, never aborted on the spot: ``ncclCommAbort``
would end the stuck kernel, and the streams waiting for it (the program's, after a
blocking op) would go on to hand the program the op's outputs, which are not results.
Held, every later use through spmd raises, and a read that waits for the op (``asnumpy``,
``.get()``, ``.item()``, a synchronize) keeps waiting.  CUDA has no way to make such a
read fail instead, so the stream is let go only when the program gives the group up
(``destroy_process_group``, ``shrink_group``), and only in a process that stays up after
device timeouts (``SPMD_DEVICE_TIMEOUT=raise``, told by ``set_timeout_policy``); the
default policy ends the process with the stream still blocked.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from spmd.backends.nccl.creation import NOCOLOR, can_split, from_unique_id
from spmd.core import cuda as _gpu
from spmd.core.context import GroupContext
from spmd.core.errors import DistBackendError, DistTimeoutError, GroupBrokenError, located
from spmd.core.flight_recorder import NCCL_ENGINE, recorder
from spmd.core.timeouts import to_seconds
from spmd.core.wait import wait_until
from spmd.core.work import Work, observers

__all__ = ["NOCOLOR", "Communicator", "Launch", "NcclWork", "Ran", "abandoned",
           "can_split", "set_timeout_policy"]

SPARE_EVENTS = 64      # end events of passed operations a communicator keeps for reuse


def _ends() -> bool:
    return False


# Whether this process stays up after one of its device ops timed out (the runtime's
# policy): only then is a held communicator's stream ever let go.  Until the runtime says,
# it is not.
_stays_up: Callable[[], bool] = _ends

# Held communicators given up in a process that is ending: kept, with the arrays their
# ops hold, so that nothing frees memory the blocked GPU may still write.
abandoned: list[Communicator] = []


def set_timeout_policy(stays_up: Callable[[], bool]) -> None:
    """Install the runtime's answer to "does this process go on after a device op of it
    timed out?" (asked when a held communicator's group is given up)."""
    global _stays_up
    _stays_up = stays_up


class Communicator:
    """One group's NCCL communicator, its stream and its operations in flight.

    What an operation needs besides its NCCL call is made once: the stream, the event the
    stream waits on, and end events, which come back (``spare``) once their operation
    has been seen complete and are recorded again by later operations.
    """

    __slots__ = ("aborted", "broken", "caller", "cp", "created_by", "device", "group",
                 "group_broken", "held", "inflight", "nccl", "nccl_comm", "ready", "runtime",
                 "spare", "stream")

    def __init__(self, group: GroupContext, cp, nccl) -> None:
        self.group = group
        self.cp = cp
        self.nccl = nccl
        self.runtime = cp.cuda.runtime
        self.nccl_comm = None      # CuPy's NcclCommunicator, from the first operation on
        self.stream = None         # the stream the operations run on
        self.ready = None          # the event the stream waits on: reused (a wait takes its last record)
        self.device: int | None = None
        self.broken: str | None = None   # why it can run no more operations
        self.held = False                # a timeout broke it: see hold()
        self.aborted = False             # ncclCommAbort ran: its streams went on
        # The group's one ended state, as this communicator follows it: True once the
        # group context is broken (a timeout here or on a peer, a dead member, an NCCL
        # error), set by the context's notice (on_end), so no call polls the context.
        self.group_broken = group.error is not None
        group.on_end.append(self._group_ended)
        # The Works (or Ran records) of operations enqueued and not yet seen complete,
        # oldest first: they (and the arrays they keep) live until the GPU has passed their
        # end event, also when nobody else holds them.
        self.inflight: collections.deque[NcclWork | Ran] = collections.deque()
        self.spare: collections.deque = collections.deque()   # end events to record again
        self.caller = _CallerStream()   # .on, per thread: launches go on the caller's stream
        self.created_by: str | None = None  # "unique id" or "commSplit", for tests and spmd info

    # -- creation -----------------------------------------------------------------------

    def connect(self, op: str = "connect"):
        """Create the NCCL communicator now (collective over the group); return it."""
        if self.nccl_comm is not None:
            return self.nccl_comm
        self.check_broken(op)
        cp, ctx = self.cp, self.group
        device = _gpu.bound_device()
        with cp.cuda.Device(device):
            pending = ctx.inherited.pop("cuda", None)
            if pending is not None:
                comm, self.created_by = pending, "commSplit"
            else:
                comm = from_unique_id(ctx, cp, self.nccl, op, device)
                self.created_by = "unique id"
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.ready = cp.cuda.Event(block=False, disable_timing=True)
        self.device = device
        self.nccl_comm = comm
        return comm

    def _group_ended(self) -> None:
        """``GroupContext.on_end``: the group broke, was destroyed, or a member exited.
        Only a break ends what this communicator runs (a destroyed group shuts its engines
        down itself; a member's exit breaks the group when a collective gives up on it),
        so for the others it listens on: the context notifies once per list."""
        if self.group.error is not None:
            self.group_broken = True
        else:
            self.group.on_end.append(self._group_ended)

    def can_split(self) -> bool:
        return can_split(self.nccl)

    def split(self, color: int, key: int):
        """``ncclCommSplit`` (collective over this group: every member calls it); the new
        communicator, None for ``NOCOLOR``, or None without a call when this one does not
        exist, was aborted or cannot split."""
        comm = self.nccl_comm
        if comm is None or self.broken is not None or not self.can_split():
            return None
        with self.cp.cuda.Device(self.device):
            # Operations still queued on the parent can deadlock the split (CuPy's warning).
            self.drain()
            try:
                return comm.commSplit(color, key)
            except Exception as exc:
                raise located(DistBackendError, "split", f"ncclCommSplit failed: {exc}",
                              self.group) from exc

    def shutdown(self) -> None:
        """The group is destroyed or given up: free the communicator once its operations
        have completed; on a broken group, abort it instead (``let_go``), or abandon it
        where a timeout holds it in a process that is ending."""
        comm = self.nccl_comm
        if comm is None:
            return
        if self.broken is None and not self.group_broken:
            try:
                self.drain()
            finally:
                self.nccl_comm = None
                comm.destroy()
            self.inflight.clear()
            return
        if self.inflight:
            self.reap()
        if self.broken is None and not self.inflight:  # broken elsewhere; nothing pending here
            self.nccl_comm = None
            comm.destroy()
            return
        if self.broken is None:  # the group broke under operations still pending here
            self.hold(f"group {self.group.name} broke ({self.group.error})")
        if not self.let_go():
            abandoned.append(self)
        self.nccl_comm = None
        self.inflight.clear()

    def drain(self) -> None:
        """Block the host until every operation enqueued has completed: those on the
        communicator's stream and those blocking calls put on their callers' streams."""
        if self.stream is not None:
            self.stream.synchronize()
        for work in list(self.inflight):
            if work.on_caller:
                work.end.synchronize()

    # -- faults -------------------------------------------------------------------------

    def check_broken(self, op: str) -> None:
        if self.broken is None:
            return
        if self.held and not self.aborted:
            raise located(GroupBrokenError, op, f"the group's NCCL communicator is held after "
                          f"{self.broken}: that op's outputs are not results, and the "
                          "streams waiting for it stay blocked until the group is destroyed; "
                          "destroy the group and make a new one", self.group)
        raise located(GroupBrokenError, op, f"the group's NCCL communicator was aborted "
                      f"after {self.broken}; destroy the group and make a new one", self.group)

    def hold(self, why: str) -> None:
        """A timeout broke the communicator (``why``): every later use raises, and nothing
        is aborted, so the timed-out op's stream, and every stream ordered after it, stays
        blocked and no read of its outputs returns.  Never blocks (the watchdog calls it)."""
        if self.broken is None:
            self.broken = why
        self.held = True

    def abort(self, why: str) -> None:
        """Break the communicator (``why``) and let its streams go (``let_go``)."""
        if self.broken is None:
            self.broken = why
        self.let_go()

    def fail(self, why: str) -> None:
        """NCCL reported an error (``why``): abort the communicator and break the group,
        telling its other members (as a timeout does), so that every engine of the group
        and every peer's late op raises instead of running on."""
        self.abort(why)
        self.group.mark_broken(f"{why} on rank {self.group.rank}")

    def launch_error(self, op: str, exc: Exception) -> DistBackendError:
        """The error of an NCCL call of ``op`` that raised ``exc``, the communicator
        aborted and the group broken."""
        self.fail(f"an NCCL error in {op}")
        return located(DistBackendError, op, f"NCCL error: {exc}; the communicator was "
                       "aborted", self.group)

    def let_go(self) -> bool:
        """``ncclCommAbort``: kernels end and the streams waiting for them go on, with
        whatever the operations had written.  Refused (False) for a communicator a timeout
        holds, unless this process stays up after device timeouts: an ending process ends
        with the stream blocked."""
        if self.held and not _stays_up():
            return False
        comm = self.nccl_comm
        if comm is not None and not self.aborted:
            self.aborted = True
            with contextlib.suppress(Exception):
                comm.abort()
        return True

    def check(self, op: str) -> None:
        """Raise if the communicator is broken (aborted or held) or NCCL reports an
        asynchronous error."""
        self.check_broken(op)
        comm = self.nccl_comm
        if comm is None:
            return
        try:
            comm.check_async_error()
        except Exception as exc:
            raise self.async_error(op, exc) from exc

    def async_error(self, op: str, exc: Exception) -> DistBackendError:
        """The error of the asynchronous NCCL error ``exc`` found in ``op``, the
        communicator aborted and the group broken."""
        self.fail(f"an asynchronous NCCL error in {op}")
        return located(DistBackendError, op, f"NCCL reported an asynchronous error: {exc}; "
                       "the communicator was aborted", self.group)

    # -- completion ---------------------------------------------------------------------

    def event_passed(self, event) -> bool:
        """Whether the GPU has passed ``event``; never blocks, never raises.

        The watchdog and control threads call it too.  A CUDA call on a thread with no
        current device makes device 0 current and creates a context there (memory on
        another rank's GPU): spmd's own threads make this rank's device current first.
        """
        try:
            if threading.current_thread().name.startswith("spmd-") and \
                    self.runtime.getDevice() != self.device:
                self.runtime.setDevice(self.device)
            return bool(event.done)
        except Exception:  # noqa: BLE001 - a broken device: the timeout will say so
            return False

    def stream_wait(self, event) -> None:
        self.cp.cuda.get_current_stream().wait_event(event)

    def host_wait(self, work: NcclWork, seconds: float) -> None:
        event, spins = work.end, 0

        def done() -> bool:
            nonlocal spins
            if event.done:
                return True
            spins += 1
            if not spins & 63:
                self.check(work.op)  # an asynchronous NCCL error ends the wait at once
            return False

        def nap() -> None:
            if spins > 4096:
                time.sleep(50e-6)
            else:
                os.sched_yield()

        try:
            wait_until(done, seconds, work.op, self.group, work=work, nap=nap,
                       source="waiting on the host")
        except DistTimeoutError:
            # The diagnosis ends the job here unless the process stays up; either way the
            # op's stream stays blocked (hold, never abort).
            self.hold(f"{work.op} timed out")
            raise
        self.check(work.op)

    def reap(self) -> None:
        """Complete the operations whose end event has passed and release their arrays
        (a Work nobody holds any more completes too: its flight-recorder entry ends).
        Their end events become spare: a completed Work never asks its event again, and
        a stream that waited on it keeps what it waited for (CUDA takes an event's
        last record at the wait)."""
        inflight, spare = self.inflight, self.spare
        while inflight and inflight[0].end.done:
            work = inflight.popleft()
            # work._done: whether it completed, without testing it again (its event has
            # passed: this completes it)
            if not work._done:
                work._complete()
            end = work.end
            # (the operations of one batch share their end event: spare after the last)
            if (not inflight or inflight[0].end is not end) and len(spare) < SPARE_EVENTS:
                spare.append(end)

    # -- enqueueing ---------------------------------------------------------------------

    def launch(self, op: str, kernels: bool = True) -> Launch:
        """``with communicator.launch(op) as (comm, stream_ptr):`` — see ``Launch``."""
        return Launch(self, op, kernels)

    @contextlib.contextmanager
    def grouped(self):
        """ncclGroupStart/End around the NCCL calls inside."""
        self.nccl.groupStart()
        try:
            yield
        finally:  # (an error inside still ends the group: NCCL needs the pair)
            self.nccl.groupEnd()

    def all_reduce_here(self, a, count: int, ntype: int, nop: int) -> bool:
        """A blocking all_reduce that NCCL does alone, in place on the contiguous array
        ``a`` (``count`` elements of NCCL type ``ntype``, reduced by ``nop``), on the
        caller's current stream, where nothing but the flight recorder observes Works.

        It leaves no Work, which nobody would wait on (as the host's compiled path): its
        flight-recorder entry (the GPU says when it ended, as for a Work's) and ``a`` in
        flight until its end event passes (a ``Ran``).  It raises what that Work's wait
        would: what NCCL reported, or the group's break.  False, having done nothing,
        where it cannot run so (another observer of Works, the communicator's first op,
        another device current): ``launch`` takes those calls.
        """
        if observers and (len(observers) != 1 or observers[0] is not recorder):
            return False
        comm = self.nccl_comm
        if comm is None or self.runtime.getDevice() != self.device:
            return False
        if self.broken is not None:
            self.check_broken("all_reduce")
        if self.inflight:
            self.reap()
        cp = self.cp
        stream = cp.cuda.get_current_stream()
        if count:
            ptr = a.data.ptr
            try:
                comm.allReduce(ptr, ptr, count, ntype, nop, stream.ptr)
            except self.nccl.NcclError as exc:
                raise self.launch_error("all_reduce", exc) from exc
        spare = self.spare
        end = spare.popleft() if spare else cp.cuda.Event(block=False, disable_timing=True)
        end.record(stream)
        number = None
        if observers:
            number = recorder.begin("all_reduce", self.group, a, NCCL_ENGINE)
            ring = recorder.ring   # (what recorder.started writes for a Work)
            ring.devices[number % ring.capacity] = (self, end)
        self.inflight.append(Ran(end, a, number))
        if self.broken is not None:   # (what check() does, without its calls)
            self.check_broken("all_reduce")
        try:
            comm.check_async_error()
        except Exception as exc:
            raise self.async_error("all_reduce", exc) from exc
        if self.group_broken and not end.done:
            self.group.check_alive("all_reduce")
        return True

    def started(self, launch: Launch, outputs, keep, blocking=False, peer=None,
                op: str | None = None) -> NcclWork:
        """The Work of what ``launch`` enqueued (``op``: its name, when one launch holds
        several operations, as a batch of sends and receives does)."""
        work = NcclWork(self, launch.end, op or launch.op, outputs, keep, blocking, peer,
                        launch.on_caller)
        self.inflight.append(work)
        return work


class Ran:
    """A blocking call in flight that has no Work (``Communicator.ran``): nobody waits on
    it, and the flight recorder alone observes it."""

    __slots__ = ("end", "keep", "number")

    on_caller = True   # (it ran on its caller's stream)
    _done = False      # (reap completes it, as a Work it has not seen done)

    def __init__(self, end, keep, number: int | None) -> None:
        self.end = end          # the CUDA event recorded after the call
        self.keep = keep        # its arrays, until the GPU has passed ``end``
        self.number = number    # its flight-recorder entry (None: the recorder is off)

    def _complete(self) -> None:
        self.keep = None
        if self.number is not None:
            recorder.end(self.number)


class _CallerStream(threading.local):
    on = False   # this thread's launches go on its current stream (a blocking call)


_AS_IS = contextlib.nullcontext()  # no switch: the device (or stream) is already the one


class Launch:
    """One enqueueing on a communicator's stream.

    Entering creates the communicator at the group's first operation, completes the
    operations found done, makes the communicator's stream wait for the caller's current
    stream, and (``kernels=True``) makes the stream current so that packing and copies
    go on it too; with ``kernels=False`` only NCCL calls run inside, and they name the
    stream themselves.  While the thread's ``caller.on`` is set everything goes on the
    caller's current stream instead (``on_caller``).  Leaving records ``end`` (an event of the
    communicator's spares where it has one).  An NCCL error inside aborts the
    communicator and raises DistBackendError.
    """

    __slots__ = ("_device", "_on", "_owner", "_stream", "end", "kernels", "on_caller", "op")

    def __init__(self, owner: Communicator, op: str, kernels: bool) -> None:
        self._owner = owner
        self.op = op
        self.kernels = kernels
        self.end: Any = None   # the end event, once the launch is left

    def __enter__(self):
        owner, op = self._owner, self.op
        comm = owner.nccl_comm
        if comm is None:
            comm = owner.connect(op)
        if owner.broken is not None:
            owner.check_broken(op)
        if owner.inflight:
            owner.reap()
        cp = owner.cp
        device = _AS_IS
        if owner.runtime.getDevice() != owner.device:
            device = cp.cuda.Device(owner.device)
            device.__enter__()
        self._device = device
        current = cp.cuda.get_current_stream()
        self.on_caller = owner.caller.on
        if self.on_caller:
            self._on, self._stream = current, _AS_IS
            return comm, current.ptr
        ready, stream = owner.ready, owner.stream
        ready.record(current)
        stream.wait_event(ready)
        self._on = stream
        self._stream = inner = stream if self.kernels else _AS_IS
        if inner is not _AS_IS:
            inner.__enter__()
        return comm, stream.ptr

    def __exit__(self, kind, exc, tb) -> None:
        owner = self._owner
        try:
            if self._stream is not _AS_IS:
                self._stream.__exit__(kind, exc, tb)
            if kind is None:
                spare = owner.spare
                end = spare.popleft() if spare else \
                    owner.cp.cuda.Event(block=False, disable_timing=True)
                end.record(self._on)
                self.end = end
        finally:
            if self._device is not _AS_IS:
                self._device.__exit__(kind, exc, tb)
        if kind is not None and issubclass(kind, owner.nccl.NcclError):
            raise owner.launch_error(self.op, exc) from exc


class NcclWork(Work):
    """A started NCCL operation: an end event on the communicator's stream (or, for a
    blocking call, on the caller's)."""

    __slots__ = ("_blocking", "device_end", "end", "on_caller", "_owner", "_peer")

    engine = NCCL_ENGINE

    def __init__(self, owner: Communicator, event, op: str, outputs, keep, blocking=False,
                 peer=None, on_caller=False):
        self.end = event           # the CUDA event recorded after the operation
        self._owner = owner
        self._blocking = blocking  # barrier: waiting blocks the host
        self._peer = peer          # receives: the group rank received from
        self.on_caller = on_caller  # enqueued on the caller's stream: nothing to order
        # The flight recorder asks the end event itself whether the op has finished.
        self.device_end = (owner, event)
        super().__init__(op, owner.group, outputs, keep=keep)

    def _test(self) -> bool:
        self._owner.check(self.op)
        if self.end.done:
            return True
        self._check_group()
        return False

    def _check_group(self) -> None:
        """Raise if the group broke (a timeout here or on a peer) with this op pending:
        it can no longer complete in step with the other ranks."""
        if self._owner.group_broken and not self.end.done:
            self.group.check_alive(self.op)

    def is_completed(self) -> bool:
        """True once the GPU has passed the operation's end event; never blocks."""
        if not self._done and self._test():
            self._complete()
        return self._done

    def wait(self, timeout=None) -> bool:
        """Make the caller's current stream wait for the operation (the host does not
        wait), as c10d's NCCL Work does.  With ``timeout`` (and for barrier) the host
        waits too, at most that long.

        Raises:
            DistTimeoutError: the host waited longer than ``timeout``.
            DistBackendError: NCCL reported an error (the communicator is aborted).
        """
        if self._blocking or timeout is not None:
            self.synchronize(timeout)
            return True
        if not self._done:
            self._owner.check(self.op)
            self._check_group()
            if not self.on_caller:
                self._owner.stream_wait(self.end)
            future = self._future
            # (future._done: its state without polling, as above)
            if future is not None and not future._done:
                future.set_result(self.outputs)  # ready for use on the current stream
        if self.error is not None:
            raise self.error
        return True

    def _complete(self) -> None:
        future = self._future
        # future._done: its state without polling (done() would poll this Work again)
        if future is not None and future._done:  # already set by wait()
            self._future = None
        super()._complete()
        self._future = future

    def synchronize(self, timeout=None) -> None:
        """Block the host until the operation has completed on the GPU."""
        seconds = self.group.timeout if timeout is None else to_seconds(timeout, "Work.wait")
        if not self._done:
            self._owner.host_wait(self, seconds)
            self._complete()
        if self.error is not None:
            raise self.error

    def source_rank(self) -> int:
        """The global rank received from, after ``wait()``: the caller's stream is then
        ordered after the receive, as blocking ``recv()`` promises."""
        if self._peer is None:
            raise RuntimeError(f"{self.op}: source_rank() is only defined for receives")
        self.wait()
        return self.group.global_rank(self._peer)
