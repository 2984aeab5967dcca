"""What an engine and a Work know of their group: communicator, identity, timeout.

Backends and Works are given a ``GroupContext`` and read nothing else of the group
layer; ``spmd.runtime.group.ProcessGroup`` extends it with the public API and the engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpi4py import MPI

from spmd.core.errors import GroupBrokenError

__all__ = ["GroupContext"]


class GroupContext:
    """A group's communicator and identity, as its engines and Works see it.

    Engines read these attributes; each is set once, except ``_error``.

    Attributes:
        _comm: the group's private communicator (None once destroyed).
        _rank: this process's rank in the group.
        _size: the group's size.
        _ranks: the members' global ranks in group-rank order.
        _name: the group's name in messages.
        _desc: the group's description.
        _timeout: seconds a blocking operation may take.
        _backend_name: the backend string (``"mpi"``, ``"cpu:mpi,cuda:nccl"``...).
        _store: the key-value store given to init_process_group, or None.
        _error: why the group is broken (a timeout), or None.
        _inherited: device -> a communicator a split of the parent made for this
            group's engine of that device to adopt (NCCL's ``commSplit``).
        _bootstrap_seq: the number the members agreed on for this group's store keys
            (None until its first start-up exchange through a store).
        _bootstrap_count: how many start-up exchanges ran on this group.
    """

    def __init__(self, comm: MPI.Intracomm, ranks: Sequence[int], name: str, timeout: float,
                 backend: str, desc: str | None = None, store: Any = None):
        # None only once destroyed; every op checks that first (_check_alive), so engines
        # read it as a communicator.
        self._comm: MPI.Intracomm = comm
        self._rank = comm.Get_rank()
        self._size = comm.Get_size()
        self._ranks = tuple(int(r) for r in ranks)
        self._index = {g: i for i, g in enumerate(self._ranks)}
        self._name = name
        self._desc = desc or name
        self._timeout = timeout
        self._backend_name = backend
        self._store = store
        self._error: str | None = None
        self._op_counters: Any = None  # the flight recorder's sequence counters for this group
        self._inherited: dict[str, Any] = {}
        self._bootstrap_seq: int | None = None
        self._bootstrap_count = 0

    def _check_alive(self, op: str) -> None:
        if self._comm is None:
            raise RuntimeError(f"{op}: group {self._name} was destroyed by destroy_process_group()")
        if self._error is not None:
            raise GroupBrokenError(f"{op}: group {self._name} is broken since {self._error}; "
                                   "its ranks are out of step, so make a new group or restart "
                                   f"the job [rank {self._rank}, group {self._name}]")

    def _group_rank(self, global_rank: int) -> int:
        return self._index.get(global_rank, -1)

    def _global_rank(self, group_rank: int) -> int:
        return self._ranks[group_rank]
