"""The interface every engine implements: one method per operation of the op table.

Arguments arrive validated by the public functions (types, lengths, sizes, roots);
an engine checks only what depends on it (which dtypes and reduce ops it supports),
and does so before it starts any communication.  Roots and peers are group ranks.
An engine is given its group's context (``spmd.core.context.GroupContext``: communicator,
identity, timeout) and nothing else of the group layer.
"""

from __future__ import annotations

from typing import Any

from spmd.core.optable import ENGINE_OPS, OPS

__all__ = ["DeviceBackend", "install_op_methods"]


class DeviceBackend:
    """One group's engine for one kind of device.

    Every operation of ``spmd.core.optable.ENGINE_OPS`` is a method returning a Work; an
    engine that lacks one raises NotImplementedError naming the op and the engine.
    """

    name: str = "?"

    def __init__(self, group: Any):
        self.group = group

    def shutdown(self) -> None:
        """Release what the engine holds; the group's communicator is freed by the group."""

    def on_split(self, child: Any, color: int, key: int) -> None:
        """Called on every member after ``Comm.Split`` of the group (``child`` is this
        rank's new group or None): engines with communicators of their own split them
        too (NCCL's ``ncclCommSplit``)."""

    def batch_p2p(self, ops: list) -> list:
        """Start a batch of ``(sending, tensor, peer, tag)``; return their Works in order.
        Engines that must launch a batch together (NCCL) override it."""
        return [self.send(a, peer, tag) if sending else self.recv(a, peer, tag)
                for sending, a, peer, tag in ops]


def install_op_methods(cls: type, make: Any, doc: str) -> None:
    """Give ``cls`` one method per engine op: ``make(name)`` returns its function,
    renamed after the op so tracebacks say the op; ``doc`` is formatted with ``name``
    and ``params``."""
    for name in ENGINE_OPS:
        method = make(name)
        method.__name__ = method.__qualname__ = name
        method.__code__ = method.__code__.replace(co_name=name)
        method.__doc__ = doc.format(name=name, params=", ".join(OPS[name].params))
        setattr(cls, name, method)


def _missing(name: str):
    def method(self, *args):
        raise NotImplementedError(f"{name}: the {self.name} backend does not implement it "
                                  f"[rank {self.group._rank}, group {self.group._name}]")

    return method


install_op_methods(DeviceBackend, _missing, "Start ``{name}({params})``; return its Work.")
