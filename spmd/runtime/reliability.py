"""What the reliability machinery shares: the settings in effect (``Config``), the
control channel, the watchdog, the replaced excepthook, and the reports printed so far.
``supervision.start()`` fills it in at ``init_process_group``."""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

from spmd.backends.mpi import job
from spmd.backends.mpi.control import Channel
from spmd.core.lines import write_lines
from spmd.core.settings import Config

__all__ = ["Config", "Reliability", "config", "report", "reports", "state"]

ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


class Reliability:
    """The settings in effect and what ``supervision.start()`` created.

    That is the control channel, the watchdog, the excepthook it replaced, and this
    rank's place in the job.
    """

    __slots__ = ("channel", "config", "dumped_at", "prev_hook", "rank", "size", "watchdog")

    def __init__(self) -> None:
        self.config = Config()
        self.channel: Channel | None = None
        self.watchdog: Any = None  # the Watchdog thread, when it runs
        self.prev_hook: ExceptHook | None = None
        self.dumped_at = -1e9      # when a peer's request last made this rank dump
        self.rank = job.world_rank()
        self.size = job.world_size()


state = Reliability()
reports: collections.deque = collections.deque(maxlen=64)   # recent reports, for tests


def config() -> Config:
    """The settings in effect (defaults before init)."""
    return state.config


def report(text: str) -> None:
    """Print a rank-tagged report to stderr (and keep it in ``reports``)."""
    reports.append(text)
    tag = f"[rank {state.rank}] "
    write_lines("\n".join(tag + line for line in text.splitlines()), sys.stderr)
