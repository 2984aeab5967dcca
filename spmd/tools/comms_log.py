"""Communication statistics per op and message size: count, bytes, latency, bandwidth.

Off by default, and then it costs nothing: no observer is registered, so a Work pays
one empty-list test when it starts and one when it completes.  Turn it on for the whole
run with ``SPMD_COMMS_LOG=1`` in every rank's environment, or for a part of it::

    with spmd.tools.comms_log.enable():
        train_step()
    spmd.tools.comms_log.summary()         # every rank calls it; rank 0 prints the table

The latency of an operation runs from the moment its Work is created to the moment
its completion is seen: for a blocking call that is the call itself; for
``async_op=True`` it ends at the ``wait()`` or ``is_completed()`` that finds it done,
so overlap with computation counts as time spent.  Sizes, algbw and busbw follow
nccl-tests (see ``spmd/core/optable.py``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, TextIO

from spmd.core import work as _work
from spmd.core.lines import write_lines
from spmd.core.optable import bus_factor, work_bytes
from spmd.core.work import Work
from spmd.runtime.group import GroupArg

__all__ = ["CommsLogger", "logger", "enable", "disable", "is_enabled", "reset", "stats",
           "summary", "format_size"]

_clock = time.perf_counter


class CommsLogger:
    """The Work observer that accumulates the statistics; one per process (``logger``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight: dict[int, tuple] = {}     # id(work) -> (start, key)
        self._stats: dict[tuple, list] = {}       # (op, bytes, group size) -> [n, sum, min, max]

    def started(self, work: Work) -> None:
        self._inflight[id(work)] = (_clock(), (work._op, work_bytes(work), work._group._size))

    def completed(self, work: Work) -> None:
        t1 = _clock()
        entry = self._inflight.pop(id(work), None)
        if entry is None:  # started before the logger was turned on
            return
        dt = t1 - entry[0]
        with self._lock:
            s = self._stats.get(entry[1])
            if s is None:
                self._stats[entry[1]] = [1, dt, dt, dt]
            else:
                s[0] += 1
                s[1] += dt
                if dt < s[2]:
                    s[2] = dt
                if dt > s[3]:
                    s[3] = dt

    def reset(self) -> None:
        with self._lock:
            self._stats.clear()
            self._inflight.clear()

    def snapshot(self) -> dict[tuple, tuple]:
        """This rank's statistics: ``{(op, bytes, group size): (count, total_s, min_s, max_s)}``."""
        with self._lock:
            return {k: tuple(v) for k, v in self._stats.items()}


logger = CommsLogger()


class _Enabled:
    """What :func:`enable` returns: leaving the ``with`` block restores the previous state."""

    def __init__(self, was_on: bool):
        self._was_on = was_on

    def __enter__(self) -> _Enabled:
        return self

    def __exit__(self, *exc) -> None:
        if not self._was_on:
            disable()


def enable() -> _Enabled:
    """Start recording every operation of this process (use as a call or a ``with``)."""
    was_on = is_enabled()
    _work.add_observer(logger)
    return _Enabled(was_on)


def disable() -> None:
    """Stop recording; what was recorded stays until :func:`reset`."""
    _work.remove_observer(logger)


def is_enabled() -> bool:
    return logger in _work._observers


def reset() -> None:
    """Forget everything recorded so far on this rank."""
    logger.reset()


def stats() -> dict[tuple, tuple]:
    """This rank's raw statistics, without communicating (see ``CommsLogger.snapshot``)."""
    return logger.snapshot()


def format_size(nbytes: float) -> str:
    """``8 B``, ``1 KiB``, ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:g} {unit}" if unit == "B" else f"{nbytes:.4g} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _gather(local: dict, group):
    """Every rank's snapshot, on every rank (raw mpi4py, so it is not logged itself)."""
    from spmd.runtime.group import resolve, world_state

    if world_state.world is None:
        return [local], 0
    pg = resolve(group, "comms_log.summary")
    if pg is None:
        return [local], 0
    return pg._comm.allgather(local), pg._rank


def _merge(per_rank: list[dict], size: int) -> dict:
    rows: dict[str, dict] = {}
    keys = sorted({k for d in per_rank for k in d}, key=lambda k: (k[0], k[2], k[1]))
    for op, nbytes, n in keys:
        label = op if n == size else f"{op} (n={n})"
        seen = [(r, d[(op, nbytes, n)]) for r, d in enumerate(per_rank) if (op, nbytes, n) in d]
        avgs = [(s[1] / s[0], r) for r, s in seen]
        slow_avg, slow_rank = max(avgs)
        count = max(s[0] for _, s in seen)
        algbw = nbytes / slow_avg / 1e9 if slow_avg > 0 else 0.0
        rows.setdefault(label, {})[nbytes] = {
            "count": count,
            "bytes": nbytes,
            "ranks": n,
            "total_bytes": count * nbytes,
            "total_ms": max(s[1] for _, s in seen) * 1e3,
            "avg_us": sum(a for a, _ in avgs) / len(avgs) * 1e6,
            "min_us": min(s[2] for _, s in seen) * 1e6,
            "max_us": max(s[3] for _, s in seen) * 1e6,
            "algbw_gbps": algbw,
            "busbw_gbps": algbw * bus_factor(op, n),
            "slowest_rank": slow_rank,
            "slowest_avg_us": slow_avg * 1e6,
        }
    return rows


def _table(rows: dict, nranks: int) -> str:
    head = (f"{'op':28s} {'size':>10s} {'count':>8s} {'total':>10s} {'avg us':>10s} "
            f"{'algbw GB/s':>10s} {'busbw GB/s':>10s}  slowest rank (avg us)")
    lines = [f"spmd comms log: {nranks} rank(s); latency from start to observed completion",
             head, "-" * len(head)]
    for label, by_size in rows.items():
        for nbytes, s in by_size.items():
            lines.append(
                f"{label:28s} {format_size(nbytes):>10s} {s['count']:8d} "
                f"{format_size(s['total_bytes']):>10s} {s['avg_us']:10.2f} "
                f"{s['algbw_gbps']:10.3f} {s['busbw_gbps']:10.3f}  "
                f"{s['slowest_rank']:>4d} ({s['slowest_avg_us']:.2f})")
    if not rows:
        lines.append("(nothing recorded: turn the log on with SPMD_COMMS_LOG=1 or "
                     "spmd.tools.comms_log.enable())")
    return "\n".join(lines)


def summary(as_dict: bool = False, group: GroupArg = None,
            file: TextIO | None = None) -> dict[str, Any] | str:
    """Gather every rank's statistics and report them, one row per op and size.

    Every rank of ``group`` (WORLD if None) must call it; it is a collective.  Each row
    shows the average latency over ranks and the slowest rank with its average; algbw
    and busbw are computed from the slowest rank's average (an op takes as long as its
    slowest participant).  Ops on a group of another size are listed as ``op (n=k)``.

    Args:
        as_dict: return ``{op: {size_in_bytes: {count, bytes, ranks, total_bytes,
            total_ms, avg_us, min_us, max_us, algbw_gbps, busbw_gbps, slowest_rank,
            slowest_avg_us}}}`` (the same on every rank) instead of printing.
        file: where rank 0 prints the table (stdout if None).

    Returns:
        The dict with ``as_dict=True``, else the table's text (on every rank).
    """
    per_rank, me = _gather(logger.snapshot(), group)
    rows = _merge(per_rank, len(per_rank))
    if as_dict:
        return rows
    text = _table(rows, len(per_rank))
    if me == 0:
        write_lines(text, file or sys.stdout)
    return text


if os.environ.get("SPMD_COMMS_LOG", "").strip().lower() not in ("", "0", "false", "no", "off"):
    enable()
