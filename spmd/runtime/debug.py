"""Debug mode: collectives compare their arguments across the group before they start.

With ``SPMD_DEBUG=DETAIL`` (or ``set_debug_level("DETAIL")``, or
``init_process_group(pg_options={"debug": "DETAIL"})``), every collective first
exchanges a fingerprint with the other ranks of its group: op, sequence number, dtype,
shape, root, reduce op (and per-pair sizes for all-to-all).  If they differ, every rank
of the group raises ``CollectiveMismatchError`` naming the ranks and the fields that
differ, instead of hanging or silently computing wrong data.  The exchange runs on a
private duplicate of the group's communicator, so it never matches real traffic.
It costs one small all-gather per collective; leave it off in production.

The level applies to groups that have not run an operation yet (backends are made at a
group's first operation), so set it before ``init_process_group`` or through it.  The
operations that run outside the engines (object collectives, persistent plans, MPMD
link broadcasts) check whenever the level is DETAIL at the time of the call.

``monitored_barrier`` (``spmd.api.monitored_barrier``) is a barrier that names the ranks that
did not arrive.
"""

from __future__ import annotations

import enum

from spmd.backends import checked, registry
from spmd.backends.checked import CheckedEngine
from spmd.core import settings

__all__ = [
    "DebugLevel",
    "get_debug_level",
    "set_debug_level",
    "set_debug_level_from_env",
]


class DebugLevel(enum.IntEnum):
    """How much checking spmd does: OFF, INFO (settings logged at init) or DETAIL."""

    OFF = 0
    INFO = 1
    DETAIL = 2


_level = DebugLevel.OFF


def get_debug_level() -> DebugLevel:
    """The current debug level."""
    return _level


def set_debug_level(level: DebugLevel | int | str) -> None:
    """Set the debug level: a DebugLevel or its name (``"OFF"``, ``"INFO"``, ``"DETAIL"``).

    Raises:
        ValueError: an unknown level.
    """
    global _level
    if isinstance(level, str):
        try:
            level = DebugLevel[level.strip().upper()]
        except KeyError:
            raise ValueError(f"set_debug_level: unknown level {level!r}; expected OFF, INFO "
                             "or DETAIL") from None
    elif not isinstance(level, DebugLevel):
        raise TypeError(f"set_debug_level: expected a DebugLevel or str, got {type(level).__name__}")
    _level = level
    registry.wrapper = CheckedEngine if level >= DebugLevel.DETAIL else None
    checked.active = level >= DebugLevel.DETAIL


def set_debug_level_from_env() -> None:
    """Set the debug level from ``SPMD_DEBUG`` (OFF if unset)."""
    set_debug_level(settings.read("SPMD_DEBUG"))
