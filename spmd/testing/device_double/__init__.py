"""A CPU stand-in for the device runtime spmd's GPU engines use: CuPy arrays, CUDA
streams and events, and ``cupy.cuda.nccl`` communicators.

``install()`` makes spmd see it as CuPy and NCCL (``uninstall()`` undoes it): then
``init_process_group()`` picks NCCL for GPU arrays, and the NCCL engine, host staging,
the watchdog, the flight recorder and the diagnoses run their real code on it, under
``mpiexec`` at any world size.  What it keeps of a GPU, because spmd's logic depends on it:

- **Work runs later, in stream order.**  Copies, elementwise operations and NCCL calls
  issued on a stream are queued there; the device runs a stream's queue in order, and a
  task only ``lag`` seconds after it was queued (``SPMD_DEVICE_DOUBLE_LAG``, default
  0.2 ms), so an operation nobody synchronised is still pending, as on a GPU.  The host
  sees results only through ``get()``/``asnumpy`` (which synchronise the current stream).
- **Events** are done once their stream has run everything queued before the record;
  ``stream.wait_event`` orders one stream after another.
- **NCCL communicators** exchange data through files in a directory named by the unique
  id (``SPMD_DEVICE_DOUBLE_DIR``, default the temporary directory).  A collective finishes
  only when every member has joined it, so a rank that never calls leaves the others'
  streams blocked forever, as an NCCL hang does.  ``inject_error`` makes
  ``check_async_error`` raise; ``abort`` lets blocked tasks finish without data.  The
  last member to leave (destroy, abort, or the end of its process) removes the
  directory; one whose member never came stays, so test runs point
  ``SPMD_DEVICE_DOUBLE_DIR`` at a directory of their own and remove it.
- ``hold()`` stops the device (nothing finishes) until ``release()``: a slow GPU.

Device arrays are numpy arrays of a subclass (so MPI reads them as host memory, which
is what the staging path hands it anyway); their memory is ordinary process memory.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from spmd.core import cuda as _gpu
from spmd.testing.device_double import _arrays
from spmd.testing.device_double._arrays import DeviceArray
from spmd.testing.device_double._device import (
    CUDARuntimeError,
    Device,
    Event,
    Stream,
    alloc_pinned_memory,
    get_current_stream,
    hold,
    release,
    runtime,
)
from spmd.testing.device_double._nccl import NcclCommunicator, NcclError, nccl

__all__ = ["DeviceArray", "NcclCommunicator", "NcclError", "cupy", "hold", "install",
           "nccl", "release", "runtime", "uninstall"]


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


_cuda = _module("spmd.testing.device_double.cupy.cuda", Device=Device, Stream=Stream,
                Event=Event, get_current_stream=get_current_stream, runtime=runtime,
                alloc_pinned_memory=alloc_pinned_memory, nccl=nccl,
                CUDARuntimeError=CUDARuntimeError)


class _CupyModule(types.ModuleType):
    """CuPy's array functions used by spmd and its tests; numpy's dtypes and ufuncs
    (ufuncs on device arrays queue themselves on the current stream)."""

    def __getattr__(self, name: str) -> Any:
        value = getattr(np, name)
        if isinstance(value, (np.ufunc, type)):
            return value
        raise AttributeError(f"the device double has no cupy.{name}")


cupy = _CupyModule("spmd.testing.device_double.cupy")
cupy.__dict__.update({name: getattr(_arrays, name) for name in _arrays.__all__})
cupy.__dict__.update(__version__="14.0.0", ndarray=DeviceArray, cuda=_cuda)


def install() -> None:
    """From now on spmd takes this double for CuPy and ``cupy.cuda.nccl``."""
    _gpu.use_runtime(cupy, nccl)


def uninstall() -> None:
    """spmd looks for the real CuPy again."""
    _gpu.use_runtime(None, None)

