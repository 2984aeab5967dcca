"""The host dispatcher: each call on host arrays goes to the shared-memory engine where
it measured faster than the MPI library (per op and size), to MPI everywhere else.

Ops the engine never takes, and every op when the engine is off, are bound straight to
the MPI engine's methods at construction, so they cost no extra call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spmd.backends.base import Engine, reraise
from spmd.backends.mpi import fastcall
from spmd.backends.mpi.engine import MPIEngine
from spmd.backends.mpi.fastcall import COMPILED_OPS, comm_of, streamer
from spmd.backends.mpi.fastcall import pieces as fastcall_pieces
from spmd.backends.mpi.faults import failure
from spmd.backends.mpi.packing import ArrayPieces
from spmd.backends.mpi.routes import fuses
from spmd.backends.shm.engine import shm_engine_beside
from spmd.core.context import GroupContext
from spmd.core.optable import ENGINE_OPS

__all__ = ["HostEngine"]

# The compiled call path, bound once, at the first host engine (MPI has started: importing
# fastcall started it); each host engine makes its group's FastComm.
fastcall.bind()

# The ops the shared-memory engine may take (the methods below).
_DISPATCHED = ("all_reduce", "reduce", "reduce_scatter_tensor", "broadcast", "all_gather",
               "all_gather_into_tensor", "all_reduce_coalesced")


def _pieces(tensors: list) -> Any:
    """The arrays of a fused all-reduce as the shared-memory engine takes them: in C where
    the extension is on and the arrays are plain, else in numpy."""
    return fastcall_pieces(tensors) or ArrayPieces(list(tensors), tensors[0].dtype)


class HostEngine(Engine):
    """Host arrays of one group: the shared-memory engine in front of MPI."""

    name = "mpi"

    def __init__(self, group: GroupContext):
        super().__init__(group)
        self.mpi = MPIEngine(group)
        # The engine falls back to MPI for a call its window cannot take.
        self.shm = shm_engine_beside(self.mpi)
        if self.shm is not None:
            self.shm.stream = streamer()
        # The compiled call path (None when it is off): blocking calls of the common
        # case without the Python, and without a Work.
        self.fast = comm_of(group, self.mpi.comm, self.shm)
        compiled = {} if self.fast is None else {op: getattr(self.fast, op) for op in COMPILED_OPS}
        # Each op's route, decided here once: the compiled call (None: none) and the
        # method that starts a Work, this engine's dispatcher for the ops the
        # shared-memory engine may take, the MPI engine's for the others.  The methods
        # are also this engine's attributes, for callers that start a Work directly
        # (coalescing blocks, batched point-to-point).
        self.routes: dict[str, tuple[Callable[..., bool] | None, Callable[..., Any]]] = {}
        for name in (*ENGINE_OPS, "batch_p2p"):
            if self.shm is None or name not in _DISPATCHED:
                setattr(self, name, getattr(self.mpi, name))
            self.routes[name] = (compiled.get(name), getattr(self, name))

    def run(self, op: str, async_op: bool, *args: Any) -> Any:
        """A blocking call the compiled path takes runs there (it declines, having done
        nothing, any other: a view, a dtype or reduce op MPI cannot apply itself, a size
        the shared-memory engine takes, an observer that needs a Work); every other call
        goes to its route's method and its Work.  MPI's report of a dead rank (ULFM)
        becomes the group's ProcessFailedError (``failure``)."""
        try:
            compiled, start = self.routes[op]
            if not async_op and compiled is not None and compiled(*args):
                return None
            work = start(*args)
            if async_op:
                return work
            work.wait()
            return None
        except Exception as exc:
            reraise(self, exc, op)

    def failure(self, exc: Exception, op: str) -> BaseException:
        return failure(exc, op, self.group)

    def shutdown(self) -> None:
        if self.shm is not None:
            self.shm.shutdown()
        self.mpi.shutdown()

    def abort(self) -> None:
        if self.shm is not None:
            self.shm.abandon()

    def all_reduce(self, a, op):
        if a.nbytes >= self.shm.all_reduce_from:
            return self.shm.all_reduce(a, op)
        return self.mpi.all_reduce(a, op)

    def fused_start(self, tensors: list, op: Any) -> Callable[[], Any] | None:
        """For a persistent plan of all_reduce_coalesced (the same arrays at every
        start): a function that starts it as the shared-memory engine's fused all-reduce,
        checked and laid out once; None where the engine does not fuse ``tensors`` (there
        MPI's persistent collective serves the plan; here the engine is the faster)."""
        if self.shm is None or not fuses(tensors, op, self.shm.all_reduce_from):
            return None
        pieces, shm = _pieces(tensors), self.shm
        return lambda: shm.all_reduce_coalesced(pieces, op)

    def all_reduce_coalesced(self, tensors, op):
        if fuses(tensors, op, self.shm.all_reduce_from):
            # One bucket (fuses checked its size), gathered into the engine's
            # window and reduced back into the arrays (the compiled path's call: the
            # same steps).
            return self.shm.all_reduce_coalesced(_pieces(tensors), op)
        return self.mpi.all_reduce_coalesced(tensors, op)

    def reduce(self, a, root, op):
        if a.nbytes >= self.shm.reduce_from:
            return self.shm.reduce(a, root, op)
        return self.mpi.reduce(a, root, op)

    def reduce_scatter_tensor(self, out, a, op):
        if a.nbytes >= self.shm.reduce_scatter_from:
            return self.shm.reduce_scatter_tensor(out, a, op)
        return self.mpi.reduce_scatter_tensor(out, a, op)

    def broadcast(self, a, root):
        if a.nbytes >= self.shm.broadcast_from:
            return self.shm.broadcast(a, root)
        return self.mpi.broadcast(a, root)

    def all_gather(self, outputs, a):
        if self.shm.gathers(sum(o.nbytes for o in outputs)):
            return self.shm.all_gather(outputs, a)
        return self.mpi.all_gather(outputs, a)

    def all_gather_into_tensor(self, out, a):
        if self.shm.gathers(out.nbytes):
            return self.shm.all_gather_into_tensor(out, a)
        return self.mpi.all_gather_into_tensor(out, a)
