"""spmd's errors as torch's: what the "spmd" backend raises, torch code catches as torch's.

A torch program catches ``torch.distributed.DistBackendError`` (what torch's NCCL and
gloo raise for a failed communicator, a timeout or an aborted group) and
``DistNetworkError``/``DistStoreError``.  Each spmd error that reaches torch through the
backend becomes an instance of a class deriving from both its spmd class and torch's,
so ``except dist.DistBackendError`` and ``except spmd.ProcessFailedError`` both catch
it, and its fields (``failed_ranks``, ``group_ranks``...) stay.  spmd's core never
imports torch: the conversion is the torch backend's, at the two places its errors leave
it (a Work that ends in error, an op that refuses to start).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from spmd.core import errors

__all__ = ["CollectiveMismatchError", "DistBackendError", "DistNetworkError",
           "DistStoreError", "DistTimeoutError", "GroupBrokenError", "ProcessFailedError",
           "as_torch_error", "raising_torch_errors"]


class DistBackendError(errors.DistBackendError, dist.DistBackendError):
    """spmd's DistBackendError, as torch's."""


class ProcessFailedError(errors.ProcessFailedError, dist.DistBackendError):
    """A rank of the group died: spmd's ProcessFailedError, as torch's DistBackendError."""


class GroupBrokenError(errors.GroupBrokenError, dist.DistBackendError):
    """The group is unusable after an earlier error on it, as torch's DistBackendError
    (what torch's NCCL raises for an aborted communicator)."""


class DistTimeoutError(errors.DistTimeoutError, dist.DistBackendError):
    """An op did not finish in time, as torch's DistBackendError (what torch's NCCL
    watchdog raises for a timed-out collective)."""


class CollectiveMismatchError(errors.CollectiveMismatchError, dist.DistBackendError):
    """Ranks entered different collectives (debug mode), as torch's DistBackendError."""


class DistNetworkError(errors.DistNetworkError, dist.DistNetworkError):
    """spmd's DistNetworkError, as torch's."""


class DistStoreError(errors.DistStoreError, dist.DistStoreError):
    """spmd's DistStoreError, as torch's."""


# spmd's class -> its torch face.  Exact types only: a subclass of these (spawn's) is
# not something the backend raises.
_TORCH: dict[type, type] = {
    errors.DistBackendError: DistBackendError,
    errors.ProcessFailedError: ProcessFailedError,
    errors.GroupBrokenError: GroupBrokenError,
    errors.DistTimeoutError: DistTimeoutError,
    errors.CollectiveMismatchError: CollectiveMismatchError,
    errors.DistNetworkError: DistNetworkError,
    errors.DistStoreError: DistStoreError,
}

_E = TypeVar("_E", bound=BaseException)


def as_torch_error(exc: _E) -> _E:
    """``exc`` itself, made an instance of its torch face if it is one of spmd's errors.

    The same object (its class changed, which the classes' equal layouts allow): its
    traceback, cause and fields stay, and a Work or group that keeps it raises the
    converted error from then on.
    """
    face = _TORCH.get(type(exc))
    if face is not None:
        exc.__class__ = face
    return exc


def raising_torch_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, raising spmd's errors as their torch faces (for ops that can refuse
    to start: a group already failed or broken raises at the op's start)."""
    @functools.wraps(method)
    def op(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except errors.DistError as exc:
            as_torch_error(exc)
            raise
    return op
