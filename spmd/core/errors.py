"""The exception hierarchy.

Plain ``TypeError``/``ValueError``/``RuntimeError`` are raised for mistakes a single
rank can see in its own arguments or state.  ``DistError`` and its children are for
what happens *between* ranks: timeouts, mismatched calls, broken groups, stores.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

__all__ = [
    "DistError",
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "DistTimeoutError",
    "CollectiveMismatchError",
    "GroupBrokenError",
    "ProcessFailedError",
]


class DistError(RuntimeError):
    """Base class of every error that involves more than one rank."""


class DistBackendError(DistError):
    """The communication library (MPI, NCCL) reported an error."""


class DistNetworkError(DistError):
    """A connection to a peer or a server was lost or refused."""


class DistStoreError(DistError):
    """A key-value store operation failed or timed out."""


class DistTimeoutError(DistError, TimeoutError):
    """A collective or point-to-point operation did not finish before its deadline."""


class CollectiveMismatchError(DistError):
    """Ranks of a group entered different collectives (debug mode)."""


class GroupBrokenError(DistError):
    """A group is unusable after an earlier timeout or error on it."""


class ProcessFailedError(DistBackendError):
    """A rank of the group died (found by an MPI with ULFM fault tolerance).

    Every survivor of the group gets this error, naming the same dead ranks (they agree
    on them), from the op it was in or its next op on the group; the group is then
    unusable and :func:`spmd.shrink_group` builds the survivors' group.  A subclass of
    :class:`DistBackendError`, which torch raises for a communicator that failed.

    Attributes:
        failed_ranks: the dead ranks' global ranks, sorted.
        group_ranks: the same ranks as ranks of the group (what ``shrink_group`` takes).
        op: the op that found the failure.
        group: the group's name.
        rank: this process's rank in the group.
    """

    def __init__(self, message: str, failed_ranks: tuple[int, ...] = (),
                 group_ranks: tuple[int, ...] = (), op: str = "", group: str = "",
                 rank: int = -1):
        super().__init__(message)
        self.failed_ranks = list(failed_ranks)
        self.group_ranks = list(group_ranks)
        self.op = op
        self.group = group
        self.rank = rank

    def __reduce__(self):  # pickles with its fields (spawn, object collectives)
        return (type(self), (str(self), tuple(self.failed_ranks), tuple(self.group_ranks),
                             self.op, self.group, self.rank))


_E = TypeVar("_E", bound=Exception)


class GroupIdentity(Protocol):
    """What an error message names of a group (``GroupContext`` has it)."""

    @property
    def rank(self) -> int: ...
    @property
    def name(self) -> str: ...


def located(exc_type: type[_E], op: str, msg: str, group: GroupIdentity) -> _E:
    """Build an error that names the op, the rank and the group, as every check does.

    ``all_gather_into_tensor: output has 10 elements, expected 12 [rank 2, group tp:1]``
    """
    return exc_type(f"{op}: {msg} [rank {group.rank}, group {group.name}]")
