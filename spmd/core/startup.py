"""What runs when the default group is made: the tools a setting turns on for the whole
run (``SPMD_COMMS_LOG``, ``SPMD_TRACE``) live above the runtime, which cannot import
them; the package registers them here and ``init_process_group`` runs them, so a setting
takes effect whatever the program imports."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["at_init", "run"]

_hooks: list[Callable[[], None]] = []


def at_init(hook: Callable[[], None]) -> None:
    """Run ``hook`` at every ``init_process_group`` (once registered, in order)."""
    if hook not in _hooks:
        _hooks.append(hook)


def run() -> None:
    """Called by ``init_process_group`` once MPI is up."""
    for hook in list(_hooks):
        hook()
