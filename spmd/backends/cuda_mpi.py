"""MPI for GPU (cupy) arrays: device buffers handed to a GPU-aware MPI, else staged
through pinned host memory.

Design: the host engine (HostEngine: MPI, shared memory) already knows every operation, dtype and reduce-op plan
(AVG, PREMUL_SUM, float16 in float32, packing of lists).  So the staging path copies
the device inputs into pinned host arrays, runs the *same* host operation on them, and
copies the results back into the caller's device arrays when the Work completes:
one implementation of the semantics, whatever the array's device.

When MPI can read device memory (see ``spmd.backends.gpu_aware_mpi.mpi_gpu_support``), operations that
are one contiguous buffer each way and need no arithmetic outside MPI (broadcast,
all_gather_into_tensor, all_to_all_single, send/recv, and reductions whose plan is a
plain MPI op) hand the device pointer to MPI directly.  On Open MPI only Isend/Irecv
do: its CUDA documentation lists every nonblocking collective as not CUDA-aware
outside UCX, so collectives stay staged there.

Either way the caller's current CUDA stream is synchronised before MPI touches a
device buffer (MPI knows nothing about streams), and a device pointer is never given
to an MPI that was not found (or declared) GPU-aware: that would be a segfault, not an
error.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from spmd.backends import gpu_aware_mpi as _aware
from spmd.backends.base import Engine
from spmd.backends.host import HostEngine
from spmd.backends.mpi.faults import failure
from spmd.backends.mpi.work import MPIWork
from spmd.backends.reduction import PLANS, counts_displs
from spmd.backends.registry import Backend
from spmd.core import cuda as _gpu
from spmd.core.arrays import contiguous, movable
from spmd.core.context import GroupContext
from spmd.core.work import Work, then

__all__ = ["CudaMPIEngine"]

_IN_PLACE = MPI.IN_PLACE
_D2H, _H2D = 2, 1  # cudaMemcpyDeviceToHost, cudaMemcpyHostToDevice


def direct_plan(dtype, op):
    """The host plan when a reduction can run on the device buffer as it is (a plain MPI
    op, at most a same-width view), else None."""
    try:
        plan = PLANS[op.name][dtype]
    except (KeyError, AttributeError):
        return None
    return plan if type(plan) is not str and plan.simple else None


def mpi_view(a, plan):
    return a if plan.view is None else a.view(plan.view)


class CudaMPIEngine(Engine):
    """MPI collectives and point-to-point operations on cupy arrays."""

    name = "mpi"

    def __init__(self, group: GroupContext):
        super().__init__(group)
        self.cp = _gpu.need_cupy("spmd", "the MPI backend for GPU arrays", group)
        # The group's own host backend when it is MPI (one engine per group), else ours.
        # The engine itself, not debug mode's wrapper: the GPU call was checked already.
        engines = group.engines if self._cpu_is_mpi(group) else None
        host = engines["cpu"] if engines is not None else None
        host = getattr(host, "inner", host)
        self._own_host = not isinstance(host, HostEngine)
        self.host = host if isinstance(host, HostEngine) else HostEngine(group)
        self.comm = group.comm
        self.rank = group.rank
        support = _aware.mpi_gpu_support()
        self.support = support
        self.direct = support.aware  # point to point
        self.direct_collectives = support.aware and support.nonblocking_collectives
        self.direct_reductions = support.aware and support.nonblocking_reductions

    def failure(self, exc: Exception, op: str) -> BaseException:
        return failure(exc, op, self.group)

    def shutdown(self) -> None:
        if self._own_host:
            self.host.shutdown()

    def abort(self) -> None:
        if self._own_host:
            self.host.abort()

    @staticmethod
    def _cpu_is_mpi(group: GroupContext) -> bool:
        return Backend.device_map(group.backend_name).get("cpu") == "mpi"

    # -- staging -------------------------------------------------------------------

    def _sync(self):
        """Everything queued on the caller's stream (the producer) has finished."""
        self.cp.cuda.get_current_stream().synchronize()

    def _pinned(self, a) -> np.ndarray:
        return _gpu.empty_pinned(self.cp, a.shape, a.dtype)

    def _down(self, arrays) -> list:
        """Pinned host copies of device arrays (None stays None), after one stream sync."""
        cp = self.cp
        stream = cp.cuda.get_current_stream()
        out: list[np.ndarray | None] = []
        keep = []  # contiguous device sources, alive until the copies are done
        for a in arrays:
            if a is None:
                out.append(None)
                continue
            h = self._pinned(a)
            if a.nbytes:
                src = contiguous(a, cp)
                keep.append(src)
                cp.cuda.runtime.memcpyAsync(h.ctypes.data, src.data.ptr, a.nbytes, _D2H,
                                            stream.ptr)
            out.append(h)
        stream.synchronize()
        return out

    def _host_outputs(self, arrays) -> list:
        """Pinned host buffers for device outputs (not copied: MPI overwrites them)."""
        self._sync()  # MPI must not race kernels still using the outputs
        return [None if a is None else self._pinned(a) for a in arrays]

    def _up(self, pairs) -> None:
        """Copy host results into their device arrays, then wait for the copies (the
        pinned buffers may be reused as soon as they are released)."""
        cp = self.cp
        stream = cp.cuda.get_current_stream()
        for dev, host in pairs:
            if not dev.nbytes:
                continue
            dst = dev if dev.flags.c_contiguous else cp.empty(dev.shape, dev.dtype)
            cp.cuda.runtime.memcpyAsync(dst.data.ptr, host.ctypes.data, dev.nbytes, _H2D,
                                        stream.ptr)
            if dst is not dev:
                cp.copyto(dev, dst)
        stream.synchronize()

    def _staged(self, work: Work, pairs, outputs) -> Work:
        """Let ``work`` (a host operation on staged buffers) finish by copying ``pairs``
        (device array, host buffer) back, and report the device arrays as its outputs."""
        up = self._up
        then(work, lambda: up(pairs))
        work.outputs = outputs
        work.keep = (work.keep, pairs)
        return work

    def _direct(self, reqs, op, outputs, keep, status=None) -> Work:
        return MPIWork(reqs, op, self.group, outputs, keep=keep, status=status)

    # -- reductions --------------------------------------------------------------------

    def all_reduce(self, a, op):
        plan = self.direct_reductions and a.flags.c_contiguous and direct_plan(a.dtype, op)
        if plan:
            self._sync()
            req = self.comm.Iallreduce(_IN_PLACE, mpi_view(a, plan), plan.mpi_op)
            return self._direct([req], "all_reduce", [a], a)
        (h,) = self._down([a])
        return self._staged(self.host.all_reduce(h, op), [(a, h)], [a])

    def all_reduce_coalesced(self, tensors, op):
        hs = self._down(tensors)
        return self._staged(self.host.all_reduce_coalesced(hs, op), list(zip(tensors, hs)),
                            list(tensors))

    def reduce(self, a, root, op):
        is_root = self.rank == root
        plan = self.direct_reductions and a.flags.c_contiguous and direct_plan(a.dtype, op)
        if plan:
            self._sync()
            buf = mpi_view(a, plan)
            if is_root:
                req = self.comm.Ireduce(_IN_PLACE, buf, plan.mpi_op, root)
            else:
                req = self.comm.Ireduce(buf, None, plan.mpi_op, root)
            return self._direct([req], "reduce", [a], a)
        (h,) = self._down([a])
        return self._staged(self.host.reduce(h, root, op), [(a, h)] if is_root else [], [a])

    def reduce_scatter_tensor(self, out, a, op):
        plan = (self.direct_reductions and a.flags.c_contiguous and out.flags.c_contiguous
                and direct_plan(a.dtype, op))
        if plan:
            self._sync()
            req = self.comm.Ireduce_scatter_block(mpi_view(a, plan), mpi_view(out, plan), plan.mpi_op)
            return self._direct([req], "reduce_scatter_tensor", [out], (a, out))
        (h,) = self._down([a])
        (ho,) = self._host_outputs([out])
        return self._staged(self.host.reduce_scatter_tensor(ho, h, op), [(out, ho)], [out])

    def reduce_scatter(self, out, inputs, op):
        hs = self._down(inputs)
        (ho,) = self._host_outputs([out])
        return self._staged(self.host.reduce_scatter(ho, hs, op), [(out, ho)], [out])

    # -- data movement -----------------------------------------------------------------

    def broadcast(self, a, root):
        if self.direct_collectives and a.flags.c_contiguous:
            self._sync()

            req = self.comm.Ibcast(movable(a), root)
            return self._direct([req], "broadcast", [a], a)
        if self.rank == root:
            (h,) = self._down([a])
            return self._staged(self.host.broadcast(h, root), [], [a])
        (h,) = self._host_outputs([a])
        return self._staged(self.host.broadcast(h, root), [(a, h)], [a])

    def all_gather(self, outputs, a):
        (h,) = self._down([a])
        hos = self._host_outputs(outputs)
        return self._staged(self.host.all_gather(hos, h), list(zip(outputs, hos)), list(outputs))

    def all_gather_into_tensor(self, out, a):
        if self.direct_collectives and a.flags.c_contiguous and out.flags.c_contiguous:
            self._sync()

            req = self.comm.Iallgather(movable(a), movable(out))
            return self._direct([req], "all_gather_into_tensor", [out], (a, out))
        (h,) = self._down([a])
        (ho,) = self._host_outputs([out])
        return self._staged(self.host.all_gather_into_tensor(ho, h), [(out, ho)], [out])

    def all_gather_coalesced(self, output_lists, inputs):
        hs = self._down(inputs)
        hls = [self._host_outputs(outs) for outs in output_lists]
        pairs = [p for outs, hos in zip(output_lists, hls) for p in zip(outs, hos)]
        return self._staged(self.host.all_gather_coalesced(hls, hs), pairs, output_lists)

    def gather(self, a, outputs, root):
        (h,) = self._down([a])
        if outputs is None:
            return self._staged(self.host.gather(h, None, root), [], [])
        hos = self._host_outputs(outputs)
        return self._staged(self.host.gather(h, hos, root), list(zip(outputs, hos)),
                            list(outputs))

    def scatter(self, out, inputs, root):
        hs = self._down(inputs) if inputs is not None else None
        (ho,) = self._host_outputs([out])
        return self._staged(self.host.scatter(ho, hs, root), [(out, ho)], [out])

    def all_to_all(self, outputs, inputs):
        hs = self._down(inputs)
        hos = self._host_outputs(outputs)
        return self._staged(self.host.all_to_all(hos, hs), list(zip(outputs, hos)),
                            list(outputs))

    def all_to_all_single(self, out, a, output_counts, input_counts):
        if self.direct_collectives and a.flags.c_contiguous and out.flags.c_contiguous:
            self._sync()

            src, dst = movable(a), movable(out)
            if input_counts is None:
                req = self.comm.Ialltoall(src, dst)
            else:
                req = self.comm.Ialltoallv([src, counts_displs(input_counts)],
                                           [dst, counts_displs(output_counts)])
            return self._direct([req], "all_to_all_single", [out], (a, out))
        (h,) = self._down([a])
        (ho,) = self._host_outputs([out])
        return self._staged(self.host.all_to_all_single(ho, h, output_counts, input_counts),
                            [(out, ho)], [out])

    def barrier(self):
        return self.host.barrier()

    # -- point to point ----------------------------------------------------------------

    def send(self, a, peer, tag):
        if self.direct and a.flags.c_contiguous:
            self._sync()

            return self._direct([self.comm.Isend(movable(a), peer, tag)], "send", [a], a)
        (h,) = self._down([a])
        return self._staged(self.host.send(h, peer, tag), [], [a])

    def recv(self, a, peer, tag):
        if self.direct and a.flags.c_contiguous:
            self._sync()

            status = MPI.Status()
            req = self.comm.Irecv(movable(a), MPI.ANY_SOURCE if peer is None else peer, tag)
            return self._direct([req], "recv", [a], a, status)
        (h,) = self._host_outputs([a])
        return self._staged(self.host.recv(h, peer, tag), [(a, h)], [a])
