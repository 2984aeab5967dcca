"""Timelines of every operation as Chrome-trace / Perfetto JSON, one file per rank.

Set ``SPMD_TRACE=trace-%r.json`` in the job's environment (``%r`` becomes the rank,
``%p`` the process id) and every rank writes its file when it exits; or trace a part of
a program::

    with spmd.tools.trace.start("trace-%r.json"):
        train_step()

Each operation is one complete ("X") event from the creation of its Work to its
observed completion, on a track per group, with the group, its size, the message size
in bytes (nccl-tests' definition), shape and dtype of the first array, and the op's
sequence number in its group (collectives and point-to-point numbered separately, so
the n-th collective of a group is the same call on every rank).  Timestamps are wall
clock microseconds, so the files of one job line up; merge them into one with::

    python -m spmd.tools.trace merge -o job.json trace-*.json     # or: spmd trace-merge ...

and open the result in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np

from spmd.core import settings
from spmd.core import work as _work
from spmd.core.flight_recorder import recorder
from spmd.core.lines import write_lines
from spmd.core.optable import P2P_OPS, work_bytes
from spmd.core.work import Work

__all__ = ["Tracer", "start", "stop", "is_tracing", "expand_path", "merge", "main"]

_clock_ns = time.perf_counter_ns
_ndarray = np.ndarray
FORMAT = "spmd-trace"


def _world() -> tuple[int, int]:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def expand_path(pattern: str, rank: int, size: int) -> str:
    """The file of ``rank``: ``%r`` is the rank, ``%p`` the process id, ``%%`` a percent.

    With several ranks and no ``%r`` in the pattern, ``.rank<R>`` goes before the
    extension so that ranks do not overwrite each other's file.
    """
    if "%r" not in pattern and size > 1:
        root, ext = os.path.splitext(pattern)
        pattern = f"{root}.rank%r{ext or '.json'}"
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "%" and i + 1 < len(pattern) and pattern[i + 1] in "rp%":
            out.append({"r": str(rank), "p": str(os.getpid()), "%": "%"}[pattern[i + 1]])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


class Tracer:
    """The Work observer that records one event per operation."""

    def __init__(self, path: str):
        self.rank, self.size = _world()
        self.path = expand_path(path, self.rank, self.size)
        self._lock = threading.Lock()
        self._events: list[tuple] = []
        self._inflight: dict[int, tuple] = {}
        self._seq: dict = {}   # group -> [collectives, p2p] started, when the recorder is off
        # One clock for the job: wall-clock microseconds, read through perf_counter.
        self._wall0_us = time.time_ns() / 1e3
        self._clk0 = _clock_ns()

    def started(self, work: Work) -> None:
        kind = 1 if work.op in P2P_OPS else 0
        number = getattr(work, "flight_number", None)
        seq = None if number is None else recorder.seq_of(number)
        if seq is None:  # recorder off: count here
            g = work.group
            counters = self._seq.get(g)
            if counters is None:
                counters = self._seq[g] = [0, 0]
            with self._lock:
                counters[kind] += 1
                seq = counters[kind]
        self._inflight[id(work)] = (_clock_ns(), seq, kind, work_bytes(work))

    def completed(self, work: Work) -> None:
        # Only references are kept here; turning them into JSON waits for write().
        entry = self._inflight.pop(id(work), None)
        if entry is None:
            return
        t1 = _clock_ns()
        outs = work.outputs
        a = outs[0] if outs else None
        if type(a) is not _ndarray:  # lists of arrays, device arrays, nothing
            if isinstance(a, (list, tuple)):
                a = a[0] if a else None
            if not hasattr(a, "shape"):
                a = None
        meta = None if a is None else (a.shape, a.dtype)  # not the array: never keep it alive
        self._events.append((t1, entry, work.op, work.group, meta, work.error is not None))

    def to_json(self) -> dict:
        """The Chrome-trace document of what was recorded so far."""
        host = socket.gethostname()
        events: list[dict] = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
             "args": {"name": f"rank {self.rank} ({host})"}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0,
             "args": {"sort_index": self.rank}},
        ]
        tids: dict[str, int] = {}
        to_us = self._wall0_us - self._clk0 / 1e3
        for t1, (t0, seq, kind, nbytes), op, g, meta, failed in list(self._events):
            gname, gsize = g.name, g.size
            shape, dtype = meta if meta is not None else (None, None)
            tid = tids.get(gname)
            if tid is None:
                tid = tids[gname] = len(tids) + 1
                events.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                               "args": {"name": f"group {gname}"}})
            args = {"group": gname, "group_size": gsize, "seq": seq, "bytes": nbytes}
            if shape is not None:
                args["shape"] = list(shape)
                args["dtype"] = str(dtype)
            if failed:
                args["failed"] = True
            events.append({"name": op, "cat": "p2p" if kind else "collective", "ph": "X",
                           "ts": round(t0 / 1e3 + to_us, 3), "dur": round((t1 - t0) / 1e3, 3),
                           "pid": self.rank, "tid": tid, "args": args})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"format": FORMAT, "rank": self.rank, "world_size": self.size,
                              "host": host, "clock": "unix time, microseconds"}}

    def write(self) -> str:
        doc = self.to_json()
        folder = os.path.dirname(self.path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(doc, f)
        return self.path


_tracer: Tracer | None = None


class _Tracing:
    """What :func:`start` returns: leaving the ``with`` block stops and writes the file."""

    def __init__(self, tracer: Tracer):
        self.tracer = tracer

    @property
    def path(self) -> str:
        return self.tracer.path

    def __enter__(self) -> _Tracing:
        return self

    def __exit__(self, *exc) -> None:
        if _tracer is self.tracer:
            stop()


def start(path: str | None = None) -> _Tracing:
    """Start tracing this process into ``path`` (a pattern, see :func:`expand_path`).

    Args:
        path: defaults to ``$SPMD_TRACE``, else ``spmd-trace-%r.json``.

    Raises:
        RuntimeError: a trace is already being recorded.
    """
    global _tracer
    if _tracer is not None:
        raise RuntimeError(f"trace.start: already tracing into {_tracer.path}; call "
                           "spmd.tools.trace.stop() first")
    _tracer = Tracer(path or settings.read("SPMD_TRACE") or "spmd-trace-%r.json")
    _work.add_observer(_tracer)
    return _Tracing(_tracer)


def stop() -> str | None:
    """Stop tracing and write the file; return its path (None if not tracing)."""
    global _tracer
    tracer, _tracer = _tracer, None
    if tracer is None:
        return None
    _work.remove_observer(tracer)
    return tracer.write()


def is_tracing() -> bool:
    return _tracer is not None


# -- merging -------------------------------------------------------------------------

def _load(path: str) -> dict:
    with open(path) as f:
        doc = json.load(f)
    if isinstance(doc, list):  # the bare-array form of the format
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or "traceEvents" not in doc:
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents)")
    return doc


def _first_world_end(doc: dict, size: int) -> float | None:
    """End time of the earliest collective on a group spanning the whole job."""
    ends = [e["ts"] + e.get("dur", 0) for e in doc["traceEvents"]
            if e.get("cat") == "collective" and e.get("args", {}).get("group_size") == size]
    return min(ends) if ends else None


def merge(paths: list[str], out: str | None = None, align: bool = False) -> dict:
    """Merge per-rank traces into one document (and write it to ``out`` if given).

    Args:
        paths: the per-rank files (from ``SPMD_TRACE`` or :func:`start`).
        out: where to write the merged trace.
        align: shift each rank's clock so that the first whole-job collective ends at
            the same time on every rank (for nodes whose clocks disagree).

    Raises:
        ValueError: no files, or a file is not a Chrome trace.
    """
    if not paths:
        raise ValueError("trace merge: no input files")
    docs = [(p, _load(p)) for p in paths]
    docs.sort(key=lambda pd: pd[1].get("otherData", {}).get("rank", 0))
    size = max(d.get("otherData", {}).get("world_size", 1) for _, d in docs)
    ref = _first_world_end(docs[0][1], size) if align else None
    events: list[dict] = []
    used: set = set()
    ranks = []
    for _path, doc in docs:
        rank = doc.get("otherData", {}).get("rank")
        pid = rank if rank is not None and rank not in used else max(used, default=-1) + 1
        used.add(pid)
        ranks.append(rank)
        shift = 0.0
        if ref is not None:
            end = _first_world_end(doc, size)
            shift = 0.0 if end is None else ref - end
        for e in doc["traceEvents"]:
            e = dict(e)
            e["pid"] = pid
            if shift and "ts" in e:
                e["ts"] = round(e["ts"] + shift, 3)
            events.append(e)
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0)))
    merged = {"traceEvents": events, "displayTimeUnit": "ms",
              "otherData": {"format": FORMAT, "merged_from": [p for p, _ in docs],
                            "ranks": ranks, "world_size": size, "aligned": bool(align)}}
    if out:
        with open(out, "w") as f:
            json.dump(merged, f)
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m spmd.tools.trace merge -o OUT FILES...``"""
    parser = argparse.ArgumentParser(prog="python -m spmd.tools.trace",
                                     description="tools for spmd's Chrome-trace files")
    sub = parser.add_subparsers(dest="command", required=True)
    add_merge_arguments(sub.add_parser("merge", help="merge per-rank traces into one file"))
    args = parser.parse_args(argv)
    return args.func(args)


def add_merge_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", help="per-rank trace files")
    p.add_argument("-o", "--output", required=True, help="merged trace file to write")
    p.add_argument("--align", action="store_true",
                   help="align rank clocks on the first whole-job collective")
    p.set_defaults(func=_merge_command)


def _merge_command(args) -> int:
    doc = merge(args.files, args.output, align=args.align)
    n = sum(1 for e in doc["traceEvents"] if e.get("ph") == "X")
    write_lines(f"{args.output}: {n} events from {len(args.files)} file(s)")
    return 0


def _start_from_env() -> None:
    if settings.read("SPMD_TRACE"):
        start(settings.read("SPMD_TRACE"))
        atexit.register(stop)


if __name__ == "__main__":
    sys.exit(main())
else:
    _start_from_env()
