"""The NCCL engine's Work (a CUDA event) and the device-array copies it makes."""

from __future__ import annotations

import numpy as np

from spmd.core.arrays import bfloat16
from spmd.core.work import Work, seconds_of

__all__ = ["NcclWork"]


class NcclWork(Work):
    """A started NCCL operation: an end event on the communicator's stream."""

    __slots__ = ("_blocking", "_event", "_owner", "_peer")

    engine = "NCCL"

    def __init__(self, owner, event, op: str, outputs, keep, blocking=False, peer=None):
        self._event = event
        self._owner = owner
        self._blocking = blocking  # barrier: waiting blocks the host
        self._peer = peer          # receives: the group rank received from
        super().__init__([], op, owner.group, outputs, keep=keep)

    @property
    def _device_end(self):
        """(engine, end event): the flight recorder asks the event itself."""
        return self._owner, self._event

    def _test(self) -> bool:
        self._owner.check(self._op)
        return bool(self._event.done)

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
            self._owner.check(self._op)
            self._owner.stream_wait(self._event)
            future = self._future
            if future is not None and not future._done:
                future.set_result(self._outputs)  # ready for use on the current stream
        if self._exc is not None:
            raise self._exc
        return True

    def _complete(self) -> None:
        future = self._future
        if future is not None and future._done:  # already set by wait()
            self._future = None
        super()._complete()
        self._future = future

    def synchronize(self, timeout=None) -> None:
        """Block the host until the operation has completed on the GPU."""
        seconds = self._group._timeout if timeout is None else seconds_of(timeout)
        if not self._done:
            self._owner.host_wait(self, seconds)
            self._complete()
        if self._exc is not None:
            raise self._exc

    def source_rank(self) -> int:
        """The global rank received from, after ``wait()``: the caller's stream is then
        ordered after the receive, as blocking ``recv()`` promises."""
        if self._peer is None:
            raise RuntimeError(f"{self._op}: source_rank() is only defined for receives")
        self.wait()
        return self._group._global_rank(self._peer)


# -- the backend ----------------------------------------------------------------------

def _contig(cp, a):
    if a.flags.c_contiguous:
        return a
    if bfloat16 is not None and a.dtype == bfloat16:
        return cp.ascontiguousarray(a.view(np.uint16)).view(bfloat16)
    return cp.ascontiguousarray(a)


def _bits(a):
    """Same-width unsigned view for copies (CuPy may lack bfloat16 kernels)."""
    return a.view(np.uint16) if bfloat16 is not None and a.dtype == bfloat16 else a


def _copy_into(cp, out, src) -> None:
    """``out[...] = src`` (same dtype and size), unless they are the same array."""
    if src is out:
        return
    if src.shape != out.shape:
        src = src.reshape(out.shape)
    cp.copyto(_bits(out), _bits(src))


def _flat_bytes(cp, a):
    """A contiguous array's bytes (a copy only when ``a`` is not contiguous)."""
    return _contig(cp, a).reshape(-1).view(np.uint8)


def _typed(buf_u8, like):
    return buf_u8.view(like.dtype).reshape(like.shape)


def _bytes_into(cp, out, src_u8) -> None:
    """Copy bytes at any offset into ``out``: straight into its bytes when it is
    contiguous, else through an aligned buffer of its dtype."""
    if not src_u8.size:
        return
    if out.flags.c_contiguous:
        out.reshape(-1).view(np.uint8)[...] = src_u8
        return
    tmp = cp.empty(out.shape, out.dtype)
    tmp.reshape(-1).view(np.uint8)[...] = src_u8
    _copy_into(cp, out, tmp)
