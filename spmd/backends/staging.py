"""GPU arrays for MPI operations outside the engines (MPMD links): the device pointer
where MPI reads device memory, else pinned host staging.

The choice is the MPI engine's for GPU arrays (``spmd.backends.cuda_mpi``): a device
pointer only where ``spmd.backends.gpu_aware_mpi.mpi_gpu_support()`` found (or was told) that MPI reads
device memory, and for nonblocking collectives only where that MPI's nonblocking
collectives do too (not Open MPI's); everything else goes through pinned host copies
made on the caller's stream.  NCCL is not among the choices: a link is an MPI
intercommunicator, and NCCL communicators join the ranks of one group only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from spmd.core.arrays import contiguous
from spmd.core.cuda import empty_pinned

__all__ = ["Staging", "use_device_pointer"]

_D2H, _H2D = 2, 1  # cudaMemcpyDeviceToHost, cudaMemcpyHostToDevice


def use_device_pointer(support: Any, a: Any, collective: bool) -> bool:
    """Whether MPI gets ``a``'s device memory itself rather than a host copy.

    Args:
        support: ``spmd.backends.gpu_aware_mpi.mpi_gpu_support()`` (a GpuAwareness).
        a: the cupy array; only a contiguous one is handed over as it is.
        collective: the operation is a nonblocking collective, not Isend/Irecv.
    """
    if not support.aware or not a.flags.c_contiguous:
        return False
    return support.nonblocking_collectives if collective else True


class Staging:
    """Copies between cupy arrays and pinned host buffers on the current CUDA stream.

    Every method first lets the work queued on the caller's stream finish (MPI knows
    nothing about streams), as the MPI engine for GPU arrays does.
    """

    def __init__(self, cp: Any):
        self.cp = cp

    def _empty_pinned(self, shape, dtype) -> np.ndarray:
        return empty_pinned(self.cp, shape, dtype)

    def sync(self) -> None:
        """Everything queued on the caller's stream (the producer) has finished."""
        self.cp.cuda.get_current_stream().synchronize()

    def down(self, a: Any) -> np.ndarray:
        """A pinned host copy of device array ``a``, complete when this returns."""
        cp = self.cp
        stream = cp.cuda.get_current_stream()
        h = self._empty_pinned(a.shape, a.dtype)
        if a.nbytes:
            src = contiguous(a, cp)
            cp.cuda.runtime.memcpyAsync(h.ctypes.data, src.data.ptr, a.nbytes, _D2H, stream.ptr)
        stream.synchronize()
        return h

    def host_buffer(self, a: Any) -> np.ndarray:
        """A pinned host buffer for MPI to write ``a``'s result into (not filled)."""
        self.sync()  # MPI's result must not race kernels still using ``a``
        return self._empty_pinned(a.shape, a.dtype)

    def up(self, a: Any, h: np.ndarray) -> None:
        """Copy the host result ``h`` into device array ``a``; complete when this returns."""
        cp = self.cp
        if not a.nbytes:
            return
        stream = cp.cuda.get_current_stream()
        dst = a if a.flags.c_contiguous else cp.empty(a.shape, a.dtype)
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, h.ctypes.data, a.nbytes, _H2D, stream.ptr)
        if dst is not a:
            cp.copyto(a, dst)
        stream.synchronize()
