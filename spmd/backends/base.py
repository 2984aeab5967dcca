"""The interface every backend implements: one method per operation, each returning a Work.

Arguments arrive validated by the public functions (types, lengths, sizes, roots);
a backend checks only what depends on it (which dtypes and reduce ops it supports),
and does so before it starts any communication.  Roots and peers are group ranks.
"""

from __future__ import annotations

import abc

__all__ = ["Backend"]


class Backend(abc.ABC):
    """One group's engine for one kind of device."""

    name: str = "?"

    def __init__(self, group):
        self.group = group

    def shutdown(self) -> None:
        """Release what the backend holds; the group's communicator is freed by the group."""

    @abc.abstractmethod
    def broadcast(self, tensor, root): ...

    @abc.abstractmethod
    def all_reduce(self, tensor, op): ...

    @abc.abstractmethod
    def all_reduce_coalesced(self, tensors, op): ...

    @abc.abstractmethod
    def reduce(self, tensor, root, op): ...

    @abc.abstractmethod
    def all_gather(self, outputs, tensor): ...

    @abc.abstractmethod
    def all_gather_into_tensor(self, output, tensor): ...

    @abc.abstractmethod
    def all_gather_coalesced(self, output_lists, inputs): ...

    @abc.abstractmethod
    def gather(self, tensor, outputs, root): ...

    @abc.abstractmethod
    def scatter(self, tensor, inputs, root): ...

    @abc.abstractmethod
    def reduce_scatter(self, output, inputs, op): ...

    @abc.abstractmethod
    def reduce_scatter_tensor(self, output, tensor, op): ...

    @abc.abstractmethod
    def all_to_all(self, outputs, inputs): ...

    @abc.abstractmethod
    def all_to_all_single(self, output, tensor, output_counts, input_counts): ...

    @abc.abstractmethod
    def barrier(self): ...

    @abc.abstractmethod
    def send(self, tensor, peer, tag): ...

    @abc.abstractmethod
    def recv(self, tensor, peer, tag): ...

    def batch_p2p(self, ops):
        """Start a batch of ``(sending, tensor, peer, tag)``; return their Works in order.
        Backends that must launch a batch together (NCCL) override it."""
        return [self.send(a, peer, tag) if sending else self.recv(a, peer, tag)
                for sending, a, peer, tag in ops]
