"""The interface every engine implements: one method per operation of the op table.

Arguments arrive validated by the public functions (types, lengths, sizes, roots);
an engine checks only what depends on it (which dtypes and reduce ops it supports),
and does so before it starts any communication.  Roots and peers are group ranks.
An engine is given its group's context (``spmd.core.context.GroupContext``: communicator,
identity, timeout) and nothing else of the group layer.

Every op of ``spmd.core.optable.ENGINE_OPS`` is declared below as a method of
:class:`Engine`, with the arguments its table entry names
(tests/unit/test_engine_interface.py keeps the two alike); an engine overrides the ones
it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, TypeAlias

from spmd.core.context import GroupContext
from spmd.core.optable import ENGINE_OPS, OPS

if TYPE_CHECKING:
    from spmd.core.ops import ReduceOp
    from spmd.core.work import Work

__all__ = ["DeviceArray", "Engine", "P2PItem", "install_op_methods", "reraise"]

# An array as engines get it: a numpy array on host engines, a cupy array on GPU ones
# (CuPy ships no type information, so the two cannot be named together).
DeviceArray: TypeAlias = Any


class P2PItem(NamedTuple):
    """One send or receive of a batch (``batch_isend_irecv``), as engines get it."""

    sending: bool         # a send (else a receive)
    tensor: DeviceArray
    peer: int | None      # the group rank of the other side (None: any source)
    tag: int


def reraise(engine: Engine, exc: Exception, op: str) -> NoReturn:
    """Raise what ``engine`` makes of ``exc``, raised by ``op``: the same error, or the
    group's failure for MPI's report of a dead rank (``Engine.failure``)."""
    err = engine.failure(exc, op)
    if err is exc:
        raise exc
    raise err from None


class Engine:
    """One group's engine for one kind of device.

    Every operation of ``spmd.core.optable.ENGINE_OPS`` is a method returning a Work; an
    engine that lacks one raises NotImplementedError naming the op and the engine.
    """

    name: str = "?"

    def __init__(self, group: GroupContext):
        self.group = group

    def fused_start(self, tensors: list, op: Any) -> Callable[[], Any] | None:
        """For a persistent plan of all_reduce_coalesced (the same arrays at every
        start): a function that starts it fused by this engine, checked and laid out
        once; None (here: every engine but the host's) where the plan's own start serves."""
        return None

    def run(self, op: str, async_op: bool, *args: Any) -> Any:
        """Run ``op`` (a name of the op table) on validated ``args``: the one entry of the
        public ops.  Returns the Work with ``async_op``, else None once the op has
        completed.  An engine with a faster way to run a blocking call (the host
        engine's compiled path) overrides it."""
        try:
            work = getattr(self, op)(*args)
            if async_op:
                return work
            work.wait()
            return None
        except Exception as exc:
            reraise(self, exc, op)

    def failure(self, exc: Exception, op: str) -> BaseException:
        """The error to raise for ``exc`` from ``op``: an engine on MPI turns MPI's report
        of a dead rank into the group's ProcessFailedError (``backends.mpi.faults``)."""
        return exc

    def shutdown(self) -> None:
        """Release what the engine holds; the group's communicator is freed by the group."""

    def abort(self) -> None:
        """Drop what the engine holds without waiting for any other rank (a member died,
        or shrink_group replaces the group): nothing collective, nothing that blocks."""

    def on_split(self, child: GroupContext | None, color: int, key: int) -> None:
        """Called on every member after ``Comm.Split`` of the group (``child`` is this
        rank's new group or None): engines with communicators of their own split them
        too (NCCL's ``ncclCommSplit``)."""

    def batch_p2p(self, ops: list[P2PItem]) -> list:
        """Start a batch of sends and receives; return their Works in order.
        Engines that must launch a batch together (NCCL) override it."""
        works = []
        for item in ops:
            if item.sending:
                assert item.peer is not None  # batch_isend_irecv resolves every send's peer
                works.append(self.send(item.tensor, item.peer, item.tag))
            else:
                works.append(self.recv(item.tensor, item.peer, item.tag))
        return works

    def _missing(self, name: str) -> NoReturn:
        raise NotImplementedError(f"{name}: the {self.name} backend does not implement it "
                                  f"[rank {self.group.rank}, group {self.group.name}]")

    # -- the ops of the op table (spmd.core.optable.ENGINE_OPS), in its order ----------

    def broadcast(self, tensor: DeviceArray, root: int) -> Work:
        """Start ``broadcast(tensor, root)``; return its Work."""
        self._missing("broadcast")

    def all_reduce(self, tensor: DeviceArray, op: ReduceOp) -> Work:
        """Start ``all_reduce(tensor, op)``; return its Work."""
        self._missing("all_reduce")

    def all_reduce_coalesced(self, tensors: list[DeviceArray], op: ReduceOp) -> Work:
        """Start ``all_reduce_coalesced(tensors, op)``; return its Work."""
        self._missing("all_reduce_coalesced")

    def reduce(self, tensor: DeviceArray, root: int, op: ReduceOp) -> Work:
        """Start ``reduce(tensor, root, op)``; return its Work."""
        self._missing("reduce")

    def all_gather(self, outputs: list[DeviceArray], tensor: DeviceArray) -> Work:
        """Start ``all_gather(outputs, tensor)``; return its Work."""
        self._missing("all_gather")

    def all_gather_into_tensor(self, output: DeviceArray, tensor: DeviceArray) -> Work:
        """Start ``all_gather_into_tensor(output, tensor)``; return its Work."""
        self._missing("all_gather_into_tensor")

    def all_gather_coalesced(self, output_lists: list[list[DeviceArray]],
                             inputs: list[DeviceArray]) -> Work:
        """Start ``all_gather_coalesced(output_lists, inputs)``; return its Work."""
        self._missing("all_gather_coalesced")

    def gather(self, tensor: DeviceArray, outputs: list[DeviceArray] | None, root: int) -> Work:
        """Start ``gather(tensor, outputs, root)``; return its Work (``outputs``: None on
        ranks other than ``root``)."""
        self._missing("gather")

    def scatter(self, tensor: DeviceArray, inputs: list[DeviceArray] | None, root: int) -> Work:
        """Start ``scatter(tensor, inputs, root)``; return its Work (``inputs``: None on
        ranks other than ``root``)."""
        self._missing("scatter")

    def reduce_scatter(self, output: DeviceArray, inputs: list[DeviceArray],
                       op: ReduceOp) -> Work:
        """Start ``reduce_scatter(output, inputs, op)``; return its Work."""
        self._missing("reduce_scatter")

    def reduce_scatter_tensor(self, output: DeviceArray, tensor: DeviceArray,
                              op: ReduceOp) -> Work:
        """Start ``reduce_scatter_tensor(output, tensor, op)``; return its Work."""
        self._missing("reduce_scatter_tensor")

    def all_to_all(self, outputs: list[DeviceArray], inputs: list[DeviceArray]) -> Work:
        """Start ``all_to_all(outputs, inputs)``; return its Work."""
        self._missing("all_to_all")

    def all_to_all_single(self, output: DeviceArray, tensor: DeviceArray,
                          output_counts: list[int] | None,
                          input_counts: list[int] | None) -> Work:
        """Start ``all_to_all_single(output, tensor, output_counts, input_counts)``; return
        its Work (counts: elements per rank, None for equal parts)."""
        self._missing("all_to_all_single")

    def barrier(self) -> Work:
        """Start ``barrier()``; return its Work."""
        self._missing("barrier")

    def send(self, tensor: DeviceArray, peer: int, tag: int) -> Work:
        """Start ``send(tensor, peer, tag)``; return its Work."""
        self._missing("send")

    def recv(self, tensor: DeviceArray, peer: int | None, tag: int) -> Work:
        """Start ``recv(tensor, peer, tag)``; return its Work (``peer`` None: any source,
        where the engine supports it)."""
        self._missing("recv")


def install_op_methods(cls: type, make: Callable[[str], Callable[..., Any]], doc: str) -> None:
    """Give ``cls`` one method per engine op: ``make(name)`` returns its function,
    renamed after the op so tracebacks say the op; ``doc`` is formatted with ``name``
    and ``params``.  For wrappers of any engine (debug mode's ``CheckedEngine``)."""
    for name in ENGINE_OPS:
        method: Any = make(name)
        method.__name__ = method.__qualname__ = name
        method.__code__ = method.__code__.replace(co_name=name)
        method.__doc__ = doc.format(name=name, params=", ".join(OPS[name].params))
        setattr(cls, name, method)
