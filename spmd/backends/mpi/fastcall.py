"""The compiled call path: the common blocking ops on host arrays without the Python.

``spmd.backends.mpi._fastcall`` (spmd/backends/mpi/_fastcall.c, built by pip where a C
compiler is present) runs a blocking collective or send/recv on contiguous numpy arrays,
with a reduce op MPI applies itself and a size below the shared-memory engine's
thresholds, without the Python and without a Work.  It is the host engine's
(:meth:`spmd.backends.host.HostEngine.run`): each group's engine holds a ``FastComm``
(:func:`comm_of`) and calls it, after the public op has validated its arguments, with
the arguments of its own method; a call it declines runs on the engine's Python path.

The extension does not link against MPI.  :func:`bind` hands it the library mpi4py
loaded: the addresses of the MPI functions, the handle size of that library's ABI and
the handles of the datatypes and reduce ops, the same ones mpi4py would pass; so one
build works with MPICH, Open MPI or the MPI-5 ABI, and both paths make the same MPI
calls.  Waits keep what the Python path gives: the flight recorder's entry, the group's
timeout ending in the same diagnosed DistTimeoutError, signals, the GIL handed over.

``SPMD_FASTCALL=0`` turns it off (the engine's Python path then takes every call);
``spmd info`` says whether it is on and, if not, why.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from spmd.backends.mpi import faults, orphans, packing
from spmd.backends.mpi.routes import MOVED, SUMMED, handle, reduced_by_op
from spmd.core import settings
from spmd.core import wait as _wait
from spmd.core.context import GroupContext
from spmd.core.dtypes import FAMILY
from spmd.core.flight_recorder import Ring, recorder
from spmd.core.launch import loaded_libmpi
from spmd.core.work import observers

__all__ = ["COMPILED_OPS", "compiled", "reason", "bind", "comm_of", "direct", "host_arrays",
           "set_world", "WorldSlots", "GroupSlots"]

# The ops a FastComm runs (its methods of the same names and arguments as the engine's).
COMPILED_OPS = ("all_reduce", "all_reduce_coalesced", "reduce", "broadcast",
                "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                "barrier", "send", "recv")

_module: Any
try:
    from spmd.backends.mpi import _fastcall as _module
except ImportError as err:  # not built: no compiler when spmd was installed
    _module = None
    _why = f"spmd.backends.mpi._fastcall is not built ({err})"
else:
    _why = ""

_FUNCTIONS = ("MPI_Iallreduce", "MPI_Ireduce", "MPI_Ibcast", "MPI_Iallgather",
              "MPI_Ireduce_scatter_block", "MPI_Ialltoall", "MPI_Ibarrier", "MPI_Isend",
              "MPI_Irecv", "MPI_Test")

# The extension once bound (None: the Python path takes every call), and why not.
compiled: Any = None
reason = _why


def _disabled() -> bool:
    return not settings.read("SPMD_FASTCALL")


def _addresses() -> dict[str, int]:
    """The MPI functions mpi4py calls: looked up first in the process's global scope
    (where a PMPI tool preloaded with LD_PRELOAD comes first), then in mpi4py's module and
    the libmpi it loaded."""
    libs = [ctypes.CDLL(None)]
    for path in (MPI.__file__, loaded_libmpi()):
        if path:
            try:
                libs.append(ctypes.CDLL(path))
            except OSError:
                pass
    found = {}
    for name in _FUNCTIONS:
        for lib in libs:
            try:
                address = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
            except AttributeError:
                continue
            if address:
                found[name] = address
                break
        else:
            raise LookupError(f"{name} was not found in the loaded MPI library")
    return found


# Why a compiled wait ended without its op (_fastcall.c's GAVE_UP_*).
_TIMEOUT, _ENDED, _INTERRUPTED = 0, 1, 2


def _given_up(op: str, group: GroupContext, number: int, waited: float, handle: int,
              buffers: tuple, receive: bool, why: int) -> bool:
    """A compiled wait ended without its op (past the group's timeout, the group broken
    or destroyed meanwhile, or a signal's exception pending): give the op's request up
    as the Python path does (:mod:`spmd.backends.mpi.orphans`: a receive cancelled,
    anything else held with ``buffers``, the call's arrays), then raise that path's error.
    True if the op completed after all (the caller goes on as if the wait had passed);
    False for a signal, whose exception the caller raises.  ``number``: the op's
    in the flight recorder, -1 when it is off."""
    request = MPI.Request.fromhandle(handle)   # does not own the handle: C's stack does
    if why == _ENDED:   # as the Python path's wait: a last look before giving up
        end = time.monotonic() + _wait.BROKEN_GRACE
        while time.monotonic() < end:
            if request.Test():
                return True
    if orphans.give_up([request], buffers, receive=receive):
        return True
    entry = recorder.entry(number) if number >= 0 else None
    if why == _TIMEOUT:
        limit = min(waited, group.timeout)   # as the Python path's wait says it
        if entry is None:
            error: BaseException = _wait.timeout_error(op, group, limit)
        else:
            recorder.mark_timed_out(number)
            error = _wait.timeout_error(op, group, limit, seq=entry.seq, kind=entry.kind)
    else:
        if entry is not None:
            recorder.end(number, True)
        error = RuntimeError(f"{op}: the wait was interrupted")
        if why == _ENDED:
            error = group.wait_error(op, collective=not receive and op != "send") or error
            group.break_for_departure()
    if not receive:   # left running: the group is out of step (a timeout broke it already)
        why_text = "interrupted" if why == _INTERRUPTED else type(error).__name__
        group.mark_broken(f"{op} was given up on rank {group.rank} ({why_text}) with its MPI "
                          "operation still running")
    if why == _INTERRUPTED:
        return False
    raise error


def _mpi_error(code: int) -> None:
    raise MPI.Exception(code)


def _shm_all_reduce(shm: Any, pieces: Any, op: Any) -> None:
    """A fused all_reduce_coalesced of the engine's size: its fused all_reduce of the
    arrays (a ``_fastcall.Pieces``), as HostEngine.all_reduce_coalesced runs it."""
    shm.all_reduce_coalesced(pieces, op).wait()


def bind() -> None:
    """Bind the extension to this process's MPI library, the flight recorder and the
    Python functions it calls back (the group module calls it once, at import).  Leaves
    ``compiled`` None, with ``reason`` set, where the extension is missing or turned off
    or the library cannot be bound."""
    global compiled, reason
    if _module is None:
        return
    if _disabled():
        reason = "turned off (SPMD_FASTCALL=0)"
        return
    # (mpi4py's handle size, as in routes.handle)
    sizes = {MPI._sizeof(t) for t in (MPI.Comm, MPI.Datatype, MPI.Op, MPI.Request)}
    if len(sizes) != 1:
        reason = f"MPI handles of unequal sizes {sorted(sizes)}"
        return
    try:
        functions = _addresses()
    except (LookupError, OSError) as err:
        reason = str(err)
        return
    tag_ub = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767)   # 32767: MPI's minimum
    reduced = reduced_by_op()
    try:
        _module.bind(
            functions=functions, handle_size=sizes.pop(), in_place=int(MPI.IN_PLACE),
            moved={dt: route.type_handle for dt, route in MOVED.items()},
            reduced_types={op: {dt: route.type_handle for dt, route in routes.items()}
                           for op, routes in reduced.items()},
            reduced_ops={op: {dt: route.op_handle for dt, route in routes.items()}
                         for op, routes in reduced.items()},
            summed=SUMMED, tag_ub=tag_ub,
            ndarray=np.ndarray, observers=observers, recorder=recorder,
            push_out=recorder.push_out, end=recorder.end, given_up=_given_up,
            mpi_error=_mpi_error, bucket_bytes=packing.get_bucket_bytes,
            shm_all_reduce=_shm_all_reduce, failure=faults.failure)
    except TypeError as err:  # an extension built from another version of this module
        reason = f"the built extension does not match spmd ({err}); reinstall spmd"
        return
    compiled = _module
    reason = ""
    # The recorder's ring, now and after every resize: the extension writes its columns.
    recorder.listeners.append(_hand_ring)
    _hand_ring(recorder.ring)


def _hand_ring(ring: Ring) -> None:
    compiled.set_ring(**ring.columns())


def host_arrays(items: Any) -> bool:
    """Whether ``items`` (a list or tuple) holds only exact, writable numpy arrays of
    dtypes spmd supports: the output lists array_list accepts as they are, checked in C
    (False where the extension is off: array_list then checks each array itself)."""
    return compiled is not None and compiled.host_arrays(items, FAMILY)


def pieces(arrays: list) -> Any:
    """The extension's Pieces of ``arrays`` (two or more exact, C-contiguous, writable
    ndarrays of one dtype), or None (where it is off, or for other arrays)."""
    return None if compiled is None else compiled.pieces(arrays)


def streamer() -> Any:
    """The extension's ``stream(dst, src)`` (a copy into the shared window past the
    cache), or None where it is off."""
    return None if compiled is None else compiled.stream


class _Declines:
    """The public ops' entry where the extension is not built: it takes no call."""

    def __getattr__(self, op: str) -> Any:
        return _declined


def _declined(*args: Any) -> bool:
    return False


# The public ops' entry (spmd.api.collectives and p2p call ``direct.all_reduce(...)`` and
# the others with their own arguments before any Python of theirs): the extension's. It
# finds a group's FastComm in fields of WorldSlots and GroupSlots (the bases of the
# world's state and of ProcessGroup), which the group module keeps, and declines wherever
# there is none (the extension not bound, or turned off).  Where it is not built: a
# stand-in that declines every call, and plain bases.
direct: Any = _module if _module is not None else _Declines()
WorldSlots: Any = _module.WorldSlots if _module is not None else object
GroupSlots: Any = _module.GroupSlots if _module is not None else object


def set_world(world_state: Any) -> None:
    """The world's state whose ``world`` (the default group) ``direct`` reads; the
    group module calls it once."""
    if _module is not None:
        _module.set_world(world_state)


def comm_of(context: GroupContext, comm: MPI.Intracomm, shm: Any) -> Any:
    """What the extension needs of one group (None when it is off): its communicator,
    identity and timeout now; the shared-memory engine's thresholds whenever they change;
    and the end of the group (broken or destroyed), after which it takes no more calls."""
    if compiled is None:
        return None
    fast = compiled.FastComm(handle(comm), context.rank, context.size, context,
                             context.index, context.op_counters, context.timeout,
                             _wait.yields, shm, _wait.nap_after)
    if shm is not None:
        shm.on_thresholds.append(lambda sizes: fast.set_thresholds(**sizes.by_name()))
        fast.set_thresholds(**shm.thresholds().by_name())
    context.on_end.append(fast.close)
    if context.error is not None or context.comm is None:
        fast.close()
    return fast
