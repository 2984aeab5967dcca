"""Timeouts: the defaults, and the one conversion of a user's timeout to seconds.

As torch keeps them (``torch.distributed.constants``): a process group waits 30 minutes
by default (``default_pg_timeout``, non-NCCL backends), a store 300 seconds.  Every
``timeout`` argument of spmd, a ``datetime.timedelta`` or a number of seconds, goes
through :func:`to_seconds`; what None means (the group's timeout, no limit) is each
caller's.
"""

from __future__ import annotations

import numbers
import threading
from datetime import timedelta

__all__ = ["DEFAULT_PG_TIMEOUT", "DEFAULT_STORE_TIMEOUT", "MAX_SECONDS", "to_seconds"]

DEFAULT_PG_TIMEOUT = timedelta(minutes=30)
DEFAULT_STORE_TIMEOUT = timedelta(seconds=300)
MAX_SECONDS = min(threading.TIMEOUT_MAX, 1e9)   # longer waits are clamped to this


def to_seconds(timeout, where: str, *, positive: bool = False, name: str = "timeout") -> float:
    """A timedelta or a number of seconds as float seconds, at most MAX_SECONDS.

    Args:
        timeout: the value given.
        where: the call, for the message (``"new_group"``, ``"Work.wait"``...).
        positive: zero is refused too (a group's timeout); otherwise it means "do not
            wait" (a poll).
        name: the argument's name, for the message.

    Raises:
        TypeError: neither a timedelta nor a real number (bool is refused).
        ValueError: negative, NaN, or zero where ``positive``.
    """
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"{where}: {name} must be a datetime.timedelta or a number of seconds, "
                        f"got {type(timeout).__name__}")
    if not (seconds > 0 if positive else seconds >= 0):   # also NaN
        raise ValueError(f"{where}: {name} must be a {'positive' if positive else 'non-negative'} "
                         f"timedelta or number of seconds, got {timeout!r}")
    return min(seconds, MAX_SECONDS)
