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

import sys
import threading
import time
from typing import Any, NamedTuple, TextIO

from spmd.core import settings
from spmd.core import work as _work
from spmd.core.lines import write_lines
from spmd.core.optable import bus_factor, work_bytes
from spmd.core.work import Work
from spmd.runtime.group import GroupArg, resolve, world_state

__all__ = ["CommsLogger", "Key", "Timing", "logger", "enable", "disable", "is_enabled",
           "reset", "stats", "summary", "format_size"]

_clock = time.perf_counter


class Key(NamedTuple):
    """What statistics are kept by: the op, its bytes, its group's size."""

    op: str
    nbytes: int
    group_size: int


class Timing(NamedTuple):
    """The latencies of one key: how many, their sum, the least and the most (seconds)."""

    calls: int
    total_s: float
    min_s: float
    max_s: float


class _Latencies:
    """A key's running latencies (a Timing as it accumulates)."""

    __slots__ = ("calls", "total", "least", "most")

    def __init__(self, dt: float):
        self.calls, self.total, self.least, self.most = 1, dt, dt, dt

    def add(self, dt: float) -> None:
        self.calls += 1
        self.total += dt
        if dt < self.least:
            self.least = dt
        if dt > self.most:
            self.most = dt

    def timing(self) -> Timing:
        return Timing(self.calls, self.total, self.least, self.most)


class CommsLogger:
    """The Work observer that accumulates the statistics; one per process (``logger``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight: dict[int, tuple[float, Key]] = {}     # id(work) -> (start, key)
        self._stats: dict[Key, _Latencies] = {}

    def started(self, work: Work) -> None:
        self._inflight[id(work)] = (_clock(), Key(work.op, work_bytes(work), work.group.size))

    def completed(self, work: Work) -> None:
        t1 = _clock()
        started = self._inflight.pop(id(work), None)
        if started is None:  # started before the logger was turned on
            return
        t0, key = started
        with self._lock:
            s = self._stats.get(key)
            if s is None:
                self._stats[key] = _Latencies(t1 - t0)
            else:
                s.add(t1 - t0)

    def reset(self) -> None:
        with self._lock:
            self._stats.clear()
            self._inflight.clear()

    def snapshot(self) -> dict[Key, Timing]:
        """This rank's statistics: ``{Key(op, nbytes, group_size): Timing(calls, total_s,
        min_s, max_s)}`` (both are tuples)."""
        with self._lock:
            return {k: v.timing() for k, v in self._stats.items()}


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
    return logger in _work.observers


def reset() -> None:
    """Forget everything recorded so far on this rank."""
    logger.reset()


def stats() -> dict[Key, Timing]:
    """This rank's raw statistics, without communicating (see ``CommsLogger.snapshot``)."""
    return logger.snapshot()


def format_size(nbytes: float) -> str:
    """``8 B``, ``1 KiB``, ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:g} {unit}" if unit == "B" else f"{nbytes:.4g} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _gather(local: dict, group: GroupArg):
    """Every rank's snapshot, on every rank (raw mpi4py, so it is not logged itself)."""
    if world_state.world is None:
        return [local], 0
    pg = resolve(group, "comms_log.summary")
    if pg is None:
        return [local], 0
    return pg.context.comm.allgather(local), pg.context.rank


def _merge(per_rank: list[dict[Key, Timing]], size: int) -> dict:
    rows: dict[str, dict] = {}
    keys = sorted({k for d in per_rank for k in d}, key=lambda k: (k.op, k.group_size, k.nbytes))
    for key in keys:
        op, nbytes, n = key
        label = op if n == size else f"{op} (n={n})"
        seen = [(r, d[key]) for r, d in enumerate(per_rank) if key in d]
        avgs = [(s.total_s / s.calls, r) for r, s in seen]
        slow_avg, slow_rank = max(avgs)
        count = max(s.calls for _, s in seen)
        algbw = nbytes / slow_avg / 1e9 if slow_avg > 0 else 0.0
        rows.setdefault(label, {})[nbytes] = {
            "count": count,
            "bytes": nbytes,
            "ranks": n,
            "total_bytes": count * nbytes,
            "total_ms": max(s.total_s for _, s in seen) * 1e3,
            "avg_us": sum(a for a, _ in avgs) / len(avgs) * 1e6,
            "min_us": min(s.min_s for _, s in seen) * 1e6,
            "max_us": max(s.max_s for _, s in seen) * 1e6,
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


if settings.read("SPMD_COMMS_LOG"):
    enable()
