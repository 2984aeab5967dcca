"""The device of the double: streams that run their queued tasks, in order, when the
host looks (an event query, a synchronisation), events, devices and ``cuda.runtime``."""

from __future__ import annotations

import collections
import ctypes
import os
import threading
import time
import weakref

from spmd.core import settings

__all__ = ["CUDARuntimeError", "Device", "Event", "Stream", "alloc_pinned_memory", "device",
           "get_current_stream", "hold", "release", "runtime", "stream_at"]

_monotonic = time.monotonic


# -- the device: streams that run their queues when the host looks ----------------------

class _DeviceState:
    """The state of the process's one device (its streams with queued work) and its knobs."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.lag = float(settings.read("SPMD_DEVICE_DOUBLE_LAG"))
        self.held = False
        self.busy: list[Stream] = []          # streams with queued tasks
        self.by_ptr: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.local = threading.local()        # current stream stack and current device
        self.next_ptr = 16

    def progress(self) -> None:
        """Run every task whose turn has come (in order per stream, across streams)."""
        with self.lock:
            if self.held:
                return
            now = _monotonic()
            moved = True
            while moved:
                moved = False
                for s in list(self.busy):
                    moved |= s._run(now)
                    if not s._tasks:
                        self.busy.remove(s)

    def run_until(self, passed) -> None:
        """Block the host until ``passed()`` (as a CUDA synchronisation does: forever if
        the device never gets there)."""
        while True:
            self.progress()
            if passed():
                return
            time.sleep(2e-4)


device = _DeviceState()


def hold() -> None:
    """Stop the device: nothing queued finishes until :func:`release`."""
    device.held = True


def release() -> None:
    device.held = False


class Stream:
    """A CUDA stream: tasks run in the order they were queued."""

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        with device.lock:
            if null:
                self.ptr = 0
            else:
                self.ptr = device.next_ptr
                device.next_ptr += 16
            device.by_ptr[self.ptr] = self
        self._tasks: collections.deque = collections.deque()
        self.queued = 0      # tasks ever queued
        self.finished = 0    # tasks ever finished

    def _push(self, step) -> None:
        """Queue ``step()``, called by the device until it returns True."""
        with device.lock:
            self._tasks.append((_monotonic(), step))
            self.queued += 1
            if len(self._tasks) == 1:
                device.busy.append(self)

    def _run(self, now: float) -> bool:
        moved = False
        lag = device.lag
        tasks = self._tasks
        while tasks:
            t0, step = tasks[0]
            if now < t0 + lag or not step():
                break
            tasks.popleft()
            self.finished += 1
            moved = True
        return moved

    def wait_event(self, event: Event) -> None:
        stream, pos = event._stream, event._pos
        if stream is not None and stream is not self:
            self._push(lambda: stream.finished >= pos)

    def record(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pos = self.queued
        device.run_until(lambda: self.finished >= pos)

    @property
    def done(self) -> bool:
        device.progress()
        return self.finished >= self.queued

    def use(self) -> Stream:
        stack = _stream_stack()
        if stack:
            stack[-1] = self
        else:
            stack.append(self)
        return self

    def __enter__(self) -> Stream:
        _stream_stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _stream_stack().pop()


Stream.null = Stream(null=True)  # type: ignore[attr-defined]


def _stream_stack() -> list:
    stack = getattr(device.local, "streams", None)
    if stack is None:
        stack = device.local.streams = []
    return stack


def get_current_stream(device_id: int | None = None) -> Stream:
    stack = getattr(device.local, "streams", None)
    return stack[-1] if stack else Stream.null  # type: ignore[attr-defined]


class Event:
    """A CUDA event: done once its stream has run what was queued before ``record``."""

    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False):
        self._stream: Stream | None = None
        self._pos = 0

    def record(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else get_current_stream()
        with device.lock:
            self._stream, self._pos = stream, stream.queued

    @property
    def done(self) -> bool:
        s = self._stream
        if s is None or s.finished >= self._pos:
            return True
        device.progress()
        return s.finished >= self._pos

    def synchronize(self) -> None:
        s, pos = self._stream, self._pos
        if s is not None:
            device.run_until(lambda: s.finished >= pos)


class Device:
    """A CUDA device; this double has one, device 0, with a bus id of its own per process
    (ranks on one machine look like ranks on distinct GPUs)."""

    def __init__(self, device_id: int | None = None):
        self.id = runtime.getDevice() if device_id is None else int(device_id)
        self._prev: list[int] = []

    @property
    def pci_bus_id(self) -> str:
        return f"DOUBLE:{os.getpid():08X}:{self.id:02X}"

    def use(self) -> None:
        runtime.setDevice(self.id)

    def synchronize(self) -> None:
        runtime.deviceSynchronize()

    def __enter__(self) -> Device:
        self._prev.append(runtime.getDevice())
        runtime.setDevice(self.id)
        return self

    def __exit__(self, *exc) -> None:
        runtime.setDevice(self._prev.pop())


class CUDARuntimeError(RuntimeError):
    pass


class _Runtime:
    """What spmd calls of ``cupy.cuda.runtime``."""

    @staticmethod
    def getDeviceCount() -> int:
        return 1

    @staticmethod
    def getDevice() -> int:
        return getattr(device.local, "device", 0)

    @staticmethod
    def setDevice(index: int) -> None:
        if not 0 <= index < 1:
            raise CUDARuntimeError(f"cudaErrorInvalidDevice: device {index} of 1")
        device.local.device = index

    @staticmethod
    def deviceSynchronize() -> None:
        device.run_until(lambda: not device.busy)

    @staticmethod
    def getDeviceProperties(index: int) -> dict:
        return {"name": b"spmd device double", "totalGlobalMem": 2**30}

    @staticmethod
    def memcpyAsync(dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        def step() -> bool:
            ctypes.memmove(dst, src, nbytes)
            return True
        stream_at(stream)._push(step)


runtime = _Runtime()


def stream_at(ptr: int) -> Stream:
    try:
        return device.by_ptr[ptr]
    except KeyError:
        raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: no stream at {ptr:#x}") \
            from None


def alloc_pinned_memory(nbytes: int) -> bytearray:
    return bytearray(max(int(nbytes), 1))


