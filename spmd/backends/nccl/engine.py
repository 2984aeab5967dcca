"""NCCL for GPU arrays, through CuPy's ``cupy.cuda.nccl``, bootstrapped over MPI.

A group's NCCL communicator is created at the group's first GPU operation (or at
``init_process_group(device_id=...)``): group rank 0 asks NCCL for a unique id, the id
travels over the group's MPI communicator (or the init store), and every member calls
``NcclCommunicator(size, id, rank)``.  Groups split from a group that already has a
communicator get theirs from ``ncclCommSplit`` where CuPy (>= 14) and NCCL (>= 2.18)
have it.

Streams: each communicator has its own CUDA stream.  An operation makes that stream
wait for an event recorded on the caller's current stream (so the inputs are ready),
enqueues the NCCL calls (and any packing, scaling or copying back) on it, and records
an end event.  ``Work.wait()`` makes the caller's current stream wait for the end event
without blocking the host, as in c10d; ``Work.synchronize()`` blocks the host.  The
arrays of an operation are kept alive until its end event has passed.

What NCCL cannot do raises TypeError before anything is enqueued (say so in the docs):
bitwise reductions, reductions of int16/uint16 (NCCL has no such types), MIN/MAX/
PRODUCT of complex arrays (they travel as pairs of reals).  Data movement works for
every dtype (bytes are bytes).  Use ``backend="cpu:mpi,cuda:mpi"`` for those.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
import weakref

import numpy as np

from spmd.backends.base import DeviceBackend
from spmd.backends.nccl.p2p import NcclPointToPoint
from spmd.backends.nccl.plans import (
    INT_MAX,
    NCCL_TYPES,
    PLANS,
    USE_MPI,
    byte_units,
    can_split,
    cupy_count_is_int,
    host_identity,
    plan_for,
    runtime_plan,
    runtime_version,
    uid_for_cupy,
    uid_to_bytes,
)
from spmd.backends.nccl.split import split_communicator
from spmd.backends.nccl.work import NcclWork, _bytes_into, _contig, _copy_into, _flat_bytes, _typed
from spmd.backends.reduction import checked_plan, premul_factor
from spmd.core import cuda as _gpu
from spmd.core.bootstrap import broadcast_value, check_distinct_gpus
from spmd.core.errors import DistBackendError, GroupBrokenError, located
from spmd.core.flight_recorder import recorder
from spmd.core.wait import wait_until

__all__ = ["NCCL_TYPES", "NCCLBackend", "NcclWork", "plan_for", "uid_for_cupy", "uid_to_bytes"]

_AS_IS = contextlib.nullcontext()  # no switch: the device (or stream) is already the one


class NCCLBackend(NcclPointToPoint, DeviceBackend):
    """NCCL collectives and point-to-point operations on cupy arrays."""

    name = "nccl"

    def __init__(self, group):
        super().__init__(group)
        self._cp = _gpu.need_cupy("spmd", "the NCCL backend", group)
        self._nccl = _gpu.nccl_or_none()
        if self._nccl is None:
            raise RuntimeError(f"the NCCL backend cannot run here: {_gpu.nccl_problem()} "
                               f"[rank {group._rank}, group {group._name}]")
        self._runtime = self._cp.cuda.runtime
        self._comm = None
        self._stream = None
        self._ready = None   # the event the stream waits on: reused (a wait takes its last record)
        self._device = None
        self._broken: str | None = None
        # (end event, arrays kept, Work weakref, recorder entry) per op, oldest first
        self._inflight: collections.deque = collections.deque()
        self._resolved: dict = {}
        self.created_by = None  # "unique id" or "commSplit", for tests and spmd info

    # -- communicator ---------------------------------------------------------------

    def connect(self, op: str = "connect"):
        """Create the communicator now (collective over the group); return it."""
        if self._comm is not None:
            return self._comm
        self._check_broken(op)
        cp, pg = self._cp, self.group
        device = _gpu.bound_device()
        with cp.cuda.Device(device):
            pending = pg._inherited.pop("cuda", None)
            if pending is not None:
                comm, self.created_by = pending, "commSplit"
            else:
                comm, self.created_by = self._from_unique_id(op), "unique id"
            self._stream = cp.cuda.Stream(non_blocking=True)
            self._ready = cp.cuda.Event(block=False, disable_timing=True)
        self._device = device
        self._comm = comm
        return comm

    def _from_unique_id(self, op: str):
        nccl, pg = self._nccl, self.group
        bus = self._cp.cuda.Device(_gpu.bound_device()).pci_bus_id
        check_distinct_gpus(pg, pg._store, host_identity(), bus, op)
        value = None
        if pg._rank == 0:
            try:
                value = uid_to_bytes(nccl.get_unique_id())
            except Exception as exc:  # noqa: BLE001 - the others must hear about it too
                value = b"error:" + f"{type(exc).__name__}: {exc}".encode()
        raw = broadcast_value(pg, pg._store, "nccl-unique-id", value)
        if raw.startswith(b"error:"):
            raise located(DistBackendError, op, f"ncclGetUniqueId failed on group rank 0: "
                          f"{raw[6:].decode()}", pg)
        try:
            return nccl.NcclCommunicator(pg._size, uid_for_cupy(raw), pg._rank)
        except Exception as exc:
            raise located(DistBackendError, op, f"ncclCommInitRank failed: {exc}", pg) from exc

    def on_split(self, child, color: int, key: int) -> None:
        split_communicator(self, child, color, key)

    def can_split(self) -> bool:
        return can_split(self._nccl)

    def shutdown(self) -> None:
        comm, self._comm = self._comm, None
        if comm is None:
            return
        if self._broken is None:
            try:
                self._stream.synchronize()
            finally:
                comm.destroy()
        self._inflight.clear()

    def _check_broken(self, op: str) -> None:
        if self._broken is not None:
            raise located(GroupBrokenError, op, f"the group's NCCL communicator was aborted "
                          f"after {self._broken}; destroy the group and make a new one",
                          self.group)

    def _abort(self, why: str) -> None:
        self._broken = why
        comm = self._comm
        if comm is not None:
            with contextlib.suppress(Exception):
                comm.abort()

    def abort_timed_out(self, op: str, seq: int | None) -> None:
        """The watchdog found ``op`` past its timeout on the GPU: abort, so kernels end."""
        if self._broken is None:
            self._abort(f"{op} #{seq} timed out (found by the watchdog)")

    def event_passed(self, event) -> bool:
        """Whether the GPU has passed ``event``; never blocks, never raises.

        The watchdog and control threads call it too.  A CUDA call on a thread with no
        current device makes device 0 current and creates a context there (memory on
        another rank's GPU): spmd's own threads make this rank's device current first.
        """
        try:
            if threading.current_thread().name.startswith("spmd-") and \
                    self._runtime.getDevice() != self._device:
                self._runtime.setDevice(self._device)
            return bool(event.done)
        except Exception:  # noqa: BLE001 - a broken device: the timeout will say so
            return False

    def check(self, op: str) -> None:
        """Raise if the communicator was aborted or NCCL reports an asynchronous error."""
        self._check_broken(op)
        comm = self._comm
        if comm is None:
            return
        try:
            comm.check_async_error()
        except Exception as exc:
            self._abort(f"an asynchronous NCCL error in {op}")
            raise located(DistBackendError, op, f"NCCL reported an asynchronous error: {exc}; "
                          "the communicator was aborted", self.group) from exc

    def stream_wait(self, event) -> None:
        self._cp.cuda.get_current_stream().wait_event(event)

    def host_wait(self, work: NcclWork, seconds: float) -> None:
        event, spins = work._event, 0

        def done() -> bool:
            nonlocal spins
            if event.done:
                return True
            spins += 1
            if not spins & 63:
                self.check(work._op)  # an asynchronous NCCL error ends the wait at once
            return False

        def nap() -> None:
            if spins > 4096:
                time.sleep(50e-6)
            else:
                os.sched_yield()

        wait_until(done, seconds, work._op, self.group, work=work, nap=nap,
                   source="waiting on the host; the NCCL communicator was aborted",
                   on_timeout=lambda: self._abort(f"{work._op} timed out"))
        self.check(work._op)

    def _reap(self) -> None:
        """Complete the operations whose end event has passed and release their arrays;
        a Work nobody holds any more still has its flight-recorder entry finished."""
        inflight = self._inflight
        while inflight and inflight[0][0].done:
            _, _, ref, entry = inflight.popleft()
            work = ref()
            if work is not None:
                if not work._done:
                    work._complete()
            elif entry is not None:
                recorder.end(entry)

    def _plan(self, dtype, op, opname: str):
        """(plan, NCCL datatype, NCCL op, divide after) for a reduction, or raise."""
        plan = checked_plan(PLANS, dtype, op, opname, self.group)
        got = self._resolved.get(id(plan))
        if got is None:
            nccl = self._nccl
            ntype = getattr(nccl, plan.nccl_type, None)
            if ntype is None:
                raise located(TypeError, opname, f"this NCCL build has no {plan.nccl_type} "
                              f"for {dtype} arrays; {USE_MPI}", self.group)
            native_avg, refused = runtime_plan(plan, runtime_version(self._nccl))
            if refused is not None:
                raise located(TypeError, opname, f"{dtype} arrays: {refused}", self.group)
            nop, divide = getattr(nccl, plan.nccl_op), plan.avg
            if native_avg:
                nop, divide = nccl.NCCL_AVG, None
            got = self._resolved[id(plan)] = (plan, ntype, nop, divide)
        return got

    def _launch(self, op: str, body, kernels: bool = True):
        """Run ``body(comm, stream_ptr)`` on the communicator's stream after the caller's
        current stream; return (end event, what body keeps alive).  ``kernels=False``:
        body makes only NCCL calls, which take the stream explicitly (no stream switch)."""
        comm = self._comm
        if comm is None:
            comm = self.connect(op)
        if self._broken is not None:
            self._check_broken(op)
        if self._inflight:
            self._reap()
        cp = self._cp
        with (_AS_IS if self._runtime.getDevice() == self._device
              else cp.cuda.Device(self._device)):
            ready = self._ready
            ready.record(cp.cuda.get_current_stream())
            stream = self._stream
            stream.wait_event(ready)
            try:
                with stream if kernels else _AS_IS:
                    kept = body(comm, stream.ptr)
            except self._nccl.NcclError as exc:
                self._abort(f"an NCCL error in {op}")
                raise located(DistBackendError, op, f"NCCL error: {exc}; the communicator was "
                              "aborted", self.group) from exc
            end = cp.cuda.Event(block=False, disable_timing=True)
            end.record(stream)
        return end, kept

    def _work(self, op, body, outputs, keep, blocking=False, peer=None, kernels=True) -> NcclWork:
        end, kept = self._launch(op, body, kernels)
        work = NcclWork(self, end, op, outputs, (keep, kept), blocking, peer)
        self._inflight.append((end, (keep, kept), weakref.ref(work), getattr(work, "_fr", None)))
        return work

    @contextlib.contextmanager
    def _grouped(self):
        self._nccl.groupStart()
        try:
            yield
        finally:  # (an error inside still ends the group: NCCL needs the pair)
            self._nccl.groupEnd()

    def _scaled(self, a, plan, op):
        """The buffer NCCL reduces: ``a`` itself when it can, else a contiguous copy
        (scaled by the PREMUL_SUM factor when there is one)."""
        cp = self._cp
        if plan.premul:
            buf = cp.array(a, order="C")
            cp.multiply(buf, premul_factor(op), out=buf, casting="unsafe")
            return buf
        return _contig(cp, a)

    def _divide(self, buf, divide) -> None:
        if divide is None or not buf.size:
            return
        n = self.group._size
        if divide == "float":
            buf /= n
        elif divide == "uint":
            buf //= n
        else:  # truncate toward zero, as NCCL and the MPI backend do
            fix = (buf < 0) & (buf % n != 0)
            buf //= n
            buf += fix

    # -- reductions --------------------------------------------------------------------

    def all_reduce(self, a, op):
        plan, t, o, divide = self._plan(a.dtype, op, "all_reduce")

        def body(comm, s):
            buf = self._scaled(a, plan, op)
            if buf.size:
                comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size * plan.count_factor, t, o, s)
            self._divide(buf, divide)
            _copy_into(self._cp, a, buf)
            return buf

        simple = divide is None and not plan.premul and a.flags.c_contiguous  # NCCL alone
        return self._work("all_reduce", body, [a], a, kernels=not simple)

    def all_reduce_coalesced(self, tensors, op):
        cp = self._cp
        by_dtype: dict = {}
        for x in tensors:
            by_dtype.setdefault(x.dtype, []).append(x)
        plans = {dt: self._plan(dt, op, "all_reduce_coalesced") for dt in by_dtype}

        def body(comm, s):
            kept = []
            for dt, arrays in by_dtype.items():
                plan, t, o, divide = plans[dt]
                buf = cp.concatenate([_flat_bytes(cp, x) for x in arrays]).view(dt)
                if plan.premul:
                    cp.multiply(buf, premul_factor(op), out=buf, casting="unsafe")
                if buf.size:
                    comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size * plan.count_factor,
                                   t, o, s)
                self._divide(buf, divide)
                pos = 0
                for x in arrays:
                    _copy_into(cp, x, buf[pos:pos + x.size])
                    pos += x.size
                kept.append(buf)
            return kept

        return self._work("all_reduce_coalesced", body, list(tensors), list(tensors))

    def reduce(self, a, root, op):
        plan, t, o, divide = self._plan(a.dtype, op, "reduce")
        is_root = self.group._rank == root

        def body(comm, s):
            buf = self._scaled(a, plan, op)
            if buf.size:
                comm.reduce(buf.data.ptr, buf.data.ptr, buf.size * plan.count_factor, t, o,
                            root, s)
            if is_root:
                self._divide(buf, divide)
                _copy_into(self._cp, a, buf)
            return buf

        return self._work("reduce", body, [a], a)

    def reduce_scatter_tensor(self, out, a, op):
        plan, t, o, divide = self._plan(a.dtype, op, "reduce_scatter_tensor")
        cp = self._cp

        def body(comm, s):
            buf = self._scaled(a, plan, op)
            rbuf = out if out.flags.c_contiguous else cp.empty(out.shape, out.dtype)
            if out.size:
                comm.reduceScatter(buf.data.ptr, rbuf.data.ptr, out.size * plan.count_factor,
                                   t, o, s)
            self._divide(rbuf, divide)
            _copy_into(cp, out, rbuf)
            return buf, rbuf

        return self._work("reduce_scatter_tensor", body, [out], (out, a))

    def reduce_scatter(self, out, inputs, op):
        plan, t, o, divide = self._plan(out.dtype, op, "reduce_scatter")
        cp, me = self._cp, self.group._rank
        sizes = [x.size for x in inputs]

        def body(comm, s):
            rbuf = cp.empty(out.nbytes, np.uint8).view(out.dtype)
            if sizes.count(sizes[0]) == len(sizes):
                buf = cp.concatenate([_flat_bytes(cp, x) for x in inputs]).view(out.dtype)
                if plan.premul:
                    cp.multiply(buf, premul_factor(op), out=buf, casting="unsafe")
                if out.size:
                    comm.reduceScatter(buf.data.ptr, rbuf.data.ptr,
                                       out.size * plan.count_factor, t, o, s)
                kept = [buf]
            else:  # uneven: one reduce per destination, launched together
                kept = [self._scaled(x, plan, op) for x in inputs]
                with self._grouped():
                    for r, buf in enumerate(kept):
                        if buf.size:
                            dst = rbuf if r == me else buf
                            comm.reduce(buf.data.ptr, dst.data.ptr, buf.size * plan.count_factor,
                                        t, o, r, s)
            self._divide(rbuf, divide)
            _copy_into(cp, out, rbuf)
            return kept, rbuf

        return self._work("reduce_scatter", body, [out], (out, list(inputs)))

    # -- data movement -----------------------------------------------------------------

    def broadcast(self, a, root):
        cp, nccl = self._cp, self._nccl
        # Counted in the widest unit that divides the size and the address (a copy of
        # a strided array is freshly allocated, so aligned).
        unit, count = byte_units(a.nbytes, a.data.ptr if a.flags.c_contiguous else 0)
        if count > INT_MAX and cupy_count_is_int(cp.__version__):
            raise located(ValueError, "broadcast", f"tensor has {a.nbytes} bytes, more than "
                          f"CuPy {cp.__version__} can broadcast (its count is a C int); CuPy "
                          "13.4 or later can", self.group)

        def body(comm, s):
            buf = _contig(cp, a)
            if a.nbytes:
                comm.broadcast(buf.data.ptr, buf.data.ptr, count, getattr(nccl, unit), root, s)
            if self.group._rank != root:
                _copy_into(cp, a, buf)
            return buf

        return self._work("broadcast", body, [a], a)

    def all_gather_into_tensor(self, out, a):
        cp, u8 = self._cp, self._nccl.NCCL_UINT8

        def body(comm, s):
            src = _contig(cp, a)
            dst = out if out.flags.c_contiguous else cp.empty(out.shape, out.dtype)
            if a.nbytes:
                comm.allGather(src.data.ptr, dst.data.ptr, a.nbytes, u8, s)
            _copy_into(cp, out, dst)
            return src, dst

        return self._work("all_gather_into_tensor", body, [out], (out, a))

    def all_gather(self, outputs, a):
        cp, u8, me = self._cp, self._nccl.NCCL_UINT8, self.group._rank
        nbytes = [o.nbytes for o in outputs]

        def body(comm, s):
            src = _flat_bytes(cp, a)
            if nbytes.count(nbytes[0]) == len(nbytes):
                rbuf = cp.empty(len(nbytes) * a.nbytes, np.uint8)
                if a.nbytes:
                    comm.allGather(src.data.ptr, rbuf.data.ptr, a.nbytes, u8, s)
                pieces = [rbuf[i * a.nbytes:(i + 1) * a.nbytes] for i in range(len(nbytes))]
            else:  # uneven: every rank broadcasts its piece, launched together
                pieces = [src if r == me else cp.empty(n, np.uint8) for r, n in enumerate(nbytes)]
                with self._grouped():
                    for r, piece in enumerate(pieces):
                        if nbytes[r]:
                            comm.broadcast(src.data.ptr, piece.data.ptr, nbytes[r], u8, r, s)
            for o, piece in zip(outputs, pieces):
                _copy_into(cp, o, _typed(piece, o))
            return src, pieces

        return self._work("all_gather", body, list(outputs), (list(outputs), a))

    def all_gather_coalesced(self, output_lists, inputs):
        cp, u8 = self._cp, self._nccl.NCCL_UINT8
        n = self.group._size

        def body(comm, s):
            parts = [_flat_bytes(cp, x) for x in inputs]
            sbuf = cp.concatenate(parts) if parts else cp.empty(0, np.uint8)
            rbuf = cp.empty(n * sbuf.size, np.uint8)
            if sbuf.size:
                comm.allGather(sbuf.data.ptr, rbuf.data.ptr, sbuf.size, u8, s)
            for i, outs in enumerate(output_lists):
                pos = i * sbuf.size
                for o in outs:
                    # Pieces of mixed dtypes sit at byte offsets a typed view would read
                    # misaligned (a fatal CUDA error): move them as bytes.
                    _bytes_into(cp, o, rbuf[pos:pos + o.nbytes])
                    pos += o.nbytes
            return sbuf, rbuf

        return self._work("all_gather_coalesced", body, output_lists, (output_lists, inputs))

    def gather(self, a, outputs, root):
        cp, u8, me = self._cp, self._nccl.NCCL_UINT8, self.group._rank

        def body(comm, s):
            src = _flat_bytes(cp, a)
            if me != root:
                if a.nbytes:
                    with self._grouped():
                        comm.send(src.data.ptr, a.nbytes, u8, root, s)
                return src
            pieces = [src if r == me else cp.empty(o.nbytes, np.uint8)
                      for r, o in enumerate(outputs)]
            with self._grouped():
                for r, piece in enumerate(pieces):
                    if r != me and piece.size:
                        comm.recv(piece.data.ptr, piece.size, u8, r, s)
            for o, piece in zip(outputs, pieces):
                _copy_into(cp, o, _typed(piece, o))
            return src, pieces

        return self._work("gather", body, list(outputs or []), (outputs, a))

    def scatter(self, out, inputs, root):
        cp, u8, me = self._cp, self._nccl.NCCL_UINT8, self.group._rank

        def body(comm, s):
            if me != root:
                rbuf = cp.empty(out.nbytes, np.uint8)
                if out.nbytes:
                    with self._grouped():
                        comm.recv(rbuf.data.ptr, out.nbytes, u8, root, s)
                _copy_into(cp, out, _typed(rbuf, out))
                return rbuf
            srcs = [_flat_bytes(cp, x) for x in inputs]
            with self._grouped():
                for r, src in enumerate(srcs):
                    if r != me and src.size:
                        comm.send(src.data.ptr, src.size, u8, r, s)
            _copy_into(cp, out, _typed(srcs[me], out))
            return srcs

        return self._work("scatter", body, [out], (out, inputs))

    def all_to_all(self, outputs, inputs):
        cp, u8, me = self._cp, self._nccl.NCCL_UINT8, self.group._rank

        def body(comm, s):
            srcs = [_flat_bytes(cp, x) for x in inputs]
            dsts = [srcs[r] if r == me else cp.empty(o.nbytes, np.uint8)
                    for r, o in enumerate(outputs)]
            with self._grouped():
                for r in range(len(srcs)):
                    if r == me:
                        continue
                    if srcs[r].size:
                        comm.send(srcs[r].data.ptr, srcs[r].size, u8, r, s)
                    if dsts[r].size:
                        comm.recv(dsts[r].data.ptr, dsts[r].size, u8, r, s)
            for o, d in zip(outputs, dsts):
                _copy_into(cp, o, _typed(d, o))
            return srcs, dsts

        return self._work("all_to_all", body, list(outputs), (list(outputs), list(inputs)))

    def all_to_all_single(self, out, a, output_counts, input_counts):
        cp, u8, me, n = self._cp, self._nccl.NCCL_UINT8, self.group._rank, self.group._size
        item = a.itemsize
        if input_counts is None:
            input_counts = [a.size // n] * n
            output_counts = [out.size // n] * n
        in_off = np.concatenate([[0], np.cumsum(input_counts)]) * item
        out_off = np.concatenate([[0], np.cumsum(output_counts)]) * item

        def body(comm, s):
            src = _flat_bytes(cp, a)
            dst = out if out.flags.c_contiguous else cp.empty(out.shape, out.dtype)
            dst_u8 = dst.reshape(-1).view(np.uint8)
            with self._grouped():
                for r in range(n):
                    if r == me:
                        continue
                    if input_counts[r]:
                        comm.send(src.data.ptr + int(in_off[r]), input_counts[r] * item, u8, r, s)
                    if output_counts[r]:
                        comm.recv(dst_u8.data.ptr + int(out_off[r]), output_counts[r] * item,
                                  u8, r, s)
            if input_counts[me]:
                dst_u8[int(out_off[me]):int(out_off[me + 1])] = src[int(in_off[me]):int(in_off[me + 1])]
            _copy_into(cp, out, dst)
            return src, dst

        return self._work("all_to_all_single", body, [out], (out, a))

    def barrier(self):
        cp, nccl = self._cp, self._nccl

        def body(comm, s):
            buf = cp.zeros(1, np.int32)
            comm.allReduce(buf.data.ptr, buf.data.ptr, 1, nccl.NCCL_INT32, nccl.NCCL_SUM, s)
            return buf

        return self._work("barrier", body, [], None, blocking=True)
