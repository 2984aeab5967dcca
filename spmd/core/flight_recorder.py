"""Flight recorder: the last N operations of this process, for post-mortems of hangs.

Every Work is recorded when it starts and updated when it completes, as one entry of a
fixed-size ring (op, group, sequence number in the group, element count and dtype of
its first array, start and end times, state).  Collectives and point-to-point operations are
numbered separately per group, as c10d does: the n-th collective of a group is the same
call on every member, so sequence numbers line up across ranks.

Dumps are JSON, one file per rank (``spmd_fr.rank<R>.json`` in ``SPMD_DUMP_DIR``,
created 0600), or a short table on stderr.  ``spmd.tools.fr_trace`` merges the dumps of a
job and points at the first collective where the ranks diverge::

    python -m spmd.tools.fr_trace DUMP_DIR_OR_FILES...
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, cast

from mpi4py import MPI

from spmd.core.context import GroupContext
from spmd.core.lines import write_lines
from spmd.core.optable import P2P_OPS

__all__ = ["Entry", "FlightRecorder", "dump_flight_recorder", "recorder", "write_private"]

_monotonic = time.monotonic

MPI_ENGINE = "MPI"
STARTED, COMPLETED = "started", "completed"

# Ops that are not collectives: they get their own sequence numbers per group.  Links
# between programs (mpmd.py) count as point-to-point: their ranks do unequal work.
FORMAT = "spmd-flight-recorder"
VERSION = 1
DEFAULT_SIZE = 2048


class Counter:
    """Sequence numbers of one kind of operation (collective or p2p) on one group."""

    __slots__ = ("kind", "seq")

    def __init__(self, kind: str):
        self.kind = kind
        self.seq = 0        # operations started


class Entry:
    """One operation in the ring.

    Attributes:
        op: the operation's name.
        group: the group it runs on.
        seq: its number among its group's operations of its kind.
        counter: the group's Counter of its kind (``counter.kind``: collective, p2p).
        size: element count of its first array (None: no array).
        dtype: that array's dtype (None: no array).
        t0: start, ``time.monotonic()``.
        t1: end; None while in flight.  The compiled call path sets it too.
        failed: whether it ended with an error.
        timed_out: whether a timeout was reported for it (once is enough).
        engine: what runs it ("MPI", "shared memory", "NCCL").
        device: for an operation that ends on a GPU stream, (communicator, end event):
            it is over when the event has passed, whether or not anyone polled its
            Work, so whatever judges "in flight" asks the event first
            (:meth:`FlightRecorder.settle`).
    """

    __slots__ = ("op", "group", "seq", "counter", "size", "dtype", "t0", "t1", "failed",
                 "timed_out", "engine", "device")

    def __init__(self, op: str, group: GroupContext, seq: int, counter: Any, size: int | None,
                 dtype: Any, t0: float, engine: str):
        # Pairs and triples: as fast as one store a line (no tuple is built).
        self.op, self.group, self.seq = op, group, seq
        self.counter, self.size, self.dtype = counter, size, dtype
        self.t0, self.engine = t0, engine
        self.t1: float | None
        self.device: Any
        self.t1, self.failed, self.timed_out, self.device = None, False, False, None

    def mark_timed_out(self) -> None:
        """A timeout was reported for this operation (the watchdog reports it no more)."""
        self.timed_out = True

    def state(self) -> str:
        """started, completed or failed."""
        if self.t1 is None:
            return STARTED
        return "failed" if self.failed else COMPLETED

    def __repr__(self) -> str:
        group = self.group.name if self.group is not None else None
        return f"<Entry {self.op} #{self.seq} on {group}: {self.state()}>"


def ring_size(requested: int) -> int:
    """The ring's real size: at least 16 entries."""
    return max(16, int(requested))


def _placeholder() -> Entry:
    """A finished entry of no operation: what the ring starts full of."""
    # It names no group; entries() leaves it out, so every entry a reader sees has one.
    e = Entry("", cast(GroupContext, None), 0, None, None, None, 0.0, MPI_ENGINE)
    e.t1 = 0.0
    return e


_COLL, _P2P = "\0collective", "\0p2p"   # keys of a group's two counters


def _counter(group: GroupContext, op: str) -> Counter:
    """The counter of ``op`` on ``group`` (first use of the group or of the op name).

    ``group.op_counters`` maps op names to their kind's Counter, so the hot path finds it with
    one dict lookup."""
    table = group.op_counters
    if table is None:
        table = group.op_counters = {_COLL: Counter("collective"), _P2P: Counter("p2p")}
    c = table[op] = table[_P2P if op in P2P_OPS else _COLL]
    return c


def counters(group: GroupContext) -> tuple[Counter, Counter]:
    """(collectives, point-to-point) counters of ``group``."""
    table = group.op_counters
    if table is None:
        return Counter("collective"), Counter("p2p")
    return table[_COLL], table[_P2P]


def next_seq(group: GroupContext) -> int:
    """The sequence number the next collective on ``group`` will get."""
    return counters(group)[0].seq + 1


class FlightRecorder:
    """The Work observer that keeps the ring; one per process (``recorder``)."""

    def __init__(self, size: int = DEFAULT_SIZE):
        self.resize(size)
        # Set by the reliability layer at init: () -> (WORLD, every live group), for the
        # dump's group table; and where dumps go by default (None: stderr).
        self.groups_source: Callable[[], tuple[GroupContext | None, list[GroupContext]]] = \
            lambda: (None, [])
        self.dump_dir: str | None = None

    def resize(self, size: int) -> None:
        self._size = size = ring_size(size)
        # A deque with maxlen is the ring: append is O(1) and atomic (thread safe), and
        # it starts full of a finished placeholder so ring[0] always exists.
        self._ring = collections.deque([_placeholder()] * size, maxlen=size)
        self._stale: list[Entry] = []   # in-flight entries pushed out of the ring

    @property
    def size(self) -> int:
        return self._size

    # -- the hot path: called for every Work --------------------------------------

    def begin(self, op: str, g: GroupContext, a, engine: str = MPI_ENGINE) -> Entry:
        """Record ``op`` starting on group ``g`` (``a``: its first array, or None) on
        ``engine``; return the entry, which :meth:`end` completes."""
        try:
            c = g.op_counters[op]
        except (TypeError, KeyError):  # the group's or the op's first time
            c = _counter(g, op)
        c.seq = seq = c.seq + 1
        ring = self._ring
        oldest = ring[0]
        if oldest.t1 is None:  # about to push out an operation still in flight
            if oldest.device is not None:
                self.settle((oldest,))
            if oldest.t1 is None:
                self._stale.append(oldest)
        if a is None:
            e = Entry(op, g, seq, c, None, None, _monotonic(), engine)
        else:
            e = Entry(op, g, seq, c, a.size, a.dtype, _monotonic(), engine)
        ring.append(e)
        return e

    @staticmethod
    def end(e: Entry) -> None:
        """Mark an entry from :meth:`begin` completed (a device op may have been seen
        finished already: its first end time stays)."""
        if e.t1 is None:
            e.t1 = _monotonic()

    def started(self, work) -> None:
        try:
            a = work._outputs[0]
            a.size  # noqa: B018 - an array, not a list of lists
        except (TypeError, IndexError, AttributeError):  # no outputs, or a list of lists
            a = None
        e = work._fr_entry = self.begin(work._op, work._group, a, work.engine)
        device_end = work._device_end
        if device_end is not None:
            e.device = device_end

    def completed(self, work) -> None:
        try:
            e = work._fr_entry
        except AttributeError:  # started before the recorder was registered
            return
        self.end(e)
        if work._exc is not None:
            e.failed = True

    @staticmethod
    def settle(entries) -> None:
        """Mark finished the device operations among ``entries`` whose end event has
        passed (the end time is when this is first seen).  Never blocks."""
        for e in entries:
            device = e.device
            if device is not None and e.t1 is None and device[0].event_passed(device[1]):
                e.t1 = _monotonic()

    # -- queries (watchdog, control channel, dumps): never on the hot path --------

    def entries(self) -> list[Entry]:
        """Every recorded entry, oldest first (in-flight ones pushed out of the ring too),
        device operations settled first."""
        ring = [e for e in list(self._ring) if e.group is not None]
        stale = list(self._stale)
        self.settle(stale)
        self.settle(ring)
        self._stale = stale = [e for e in stale if e.t1 is None]
        return sorted(stale, key=lambda e: e.t0) + ring if stale else ring

    def in_flight(self) -> list[Entry]:
        """Entries of operations that have started and not completed, oldest first."""
        return [e for e in self.entries() if e.t1 is None]

    def group_summary(self, group: GroupContext, seq: int | None = None) -> dict:
        """Where this process is on ``group``: counts, last finished and current ops."""
        coll_count, p2p_count = counters(group)
        now = _monotonic()
        entries = self.entries()
        mine = [e for e in entries if e.group is group]
        coll = [e for e in mine if e.counter.kind == "collective"]
        done = [e for e in coll if e.t1 is not None]
        last = max(done, key=lambda e: e.seq) if done else None
        out = {
            "seq": coll_count.seq,
            "p2p_seq": p2p_count.seq,
            "last": brief(last, now) if last is not None else None,
            "current": [brief(e, now) for e in mine if e.t1 is None][:4],
            "elsewhere": [brief(e, now) for e in entries
                          if e.t1 is None and e.group is not group][-3:],
        }
        if seq is not None:
            at = [e for e in coll if e.seq == seq]
            out["at_seq"] = brief(at[-1], now) if at else None
        return out

    def snapshot(self, reason: str = "on demand") -> dict:
        """The whole recorder as a JSON-ready dict (the per-rank dump)."""
        now_mono, now_wall = _monotonic(), time.time()
        world, all_groups = self.groups_source()
        groups = {}
        for g in all_groups:
            coll, p2p = counters(g)
            groups[_group_id(g)] = {
                "name": g.name, "ranks": list(g.ranks),
                "seq": coll.seq, "p2p_seq": p2p.seq,
                "broken": g.error,
            }
        entries = []
        for i, e in enumerate(self.entries()):
            g = e.group
            entries.append({
                "id": i, "op": e.op, "group": g.name, "group_id": _group_id(g),
                "kind": e.counter.kind, "seq": e.seq,
                "size": e.size if isinstance(e.size, int) else None,
                "dtype": _dtype_name(e.dtype),
                "start": round(e.t0 - now_mono + now_wall, 6),
                "end": round(e.t1 - now_mono + now_wall, 6) if e.t1 is not None else None,
                "state": e.state(), "timed_out": e.timed_out, "engine": e.engine,
            })
        return {
            "format": FORMAT, "version": VERSION, "reason": reason,
            "rank": world.rank if world is not None else MPI.COMM_WORLD.Get_rank(),
            "world_size": world.size if world is not None else MPI.COMM_WORLD.Get_size(),
            "host": socket.gethostname(), "pid": os.getpid(), "dumped_at": now_wall,
            "capacity": self._size, "groups": groups, "entries": entries,
        }


recorder = FlightRecorder()


def _group_id(g: GroupContext) -> str:
    ranks = g.ranks
    shown = ",".join(map(str, ranks)) if len(ranks) <= 16 else \
        f"{ranks[0]},{ranks[1]},...,{ranks[-1]}({len(ranks)})"
    return f"{g.name}[{shown}]"


def _dtype_name(dtype) -> str | None:
    if dtype is None:
        return None
    return getattr(dtype, "name", None) or str(dtype)  # numpy/cupy dtypes; torch's too


def brief(e: Entry, now: float) -> dict:
    """One entry in the short form the diagnosis and the control channel use."""
    return {"op": e.op, "seq": e.seq, "kind": e.counter.kind, "group": e.group.name,
            "engine": e.engine, "state": e.state(), "age": round(now - e.t0, 3),
            "took": round(e.t1 - e.t0, 6) if e.t1 is not None else None}


def ranks_text(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-2,5``."""
    ranks = sorted(ranks)
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if j == i else
                     f"{ranks[i]},{ranks[j]}" if j == i + 1 else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(parts)


# ----------------------------------------------------------------------------- dumps

def write_private(path: str, text: str) -> None:
    """Write ``text`` to ``path``, readable and writable by the user only (0600).

    The text goes to a temporary file first, renamed over ``path`` when complete, so a
    reader never sees half a file (a job being aborted may kill the writer)."""
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # also when a stale file existed with other bits
        with os.fdopen(fd, "w") as f:
            fd = -1
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def dump_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"spmd_fr.rank{rank}.json")


def format_table(snapshot: dict, last: int | None = 12) -> str:
    """A dump as text: one line per operation, newest last."""
    entries = snapshot["entries"]
    if last is not None:
        entries = entries[-last:]
    lines = [(f"[rank {snapshot['rank']}] flight recorder ({snapshot['reason']}): last "
              f"{len(entries)} of {len(snapshot['entries'])} recorded ops")]
    t_ref = snapshot["dumped_at"]
    for e in entries:
        what = f"{e['op']} #{e['seq']}" + (" (p2p)" if e["kind"] == "p2p" else "")
        arr = f"{e['size']} x {e['dtype']}" if e["dtype"] is not None else "-"
        took = f"{(e['end'] - e['start']) * 1e3:.3f} ms" if e["end"] is not None else "-"
        state = e["state"] + (" (timed out)" if e["timed_out"] else "")
        lines.append(f"[rank {snapshot['rank']}]   {what:28s} group {e['group']:12s} "
                     f"{arr:22s} started {t_ref - e['start']:8.3f} s ago  took {took:>12s}  {state}")
    return "\n".join(lines)


def dump(directory: str | None, reason: str, last: int | None = 12) -> str | None:
    """Dump this rank's recorder to ``directory`` (a file per rank), or to stderr."""
    snap = recorder.snapshot(reason)
    if directory:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        path = dump_path(directory, snap["rank"])
        write_private(path, json.dumps(snap, indent=1))
        return path
    write_lines(format_table(snap, last), sys.stderr)
    return None


def dump_flight_recorder(path: str | None = None) -> str | None:
    """Dump this rank's flight recorder; any rank may call it at any time.

    Args:
        path: a directory for the per-rank file ``spmd_fr.rank<R>.json`` (created
            0600); ``SPMD_DUMP_DIR`` (or ``pg_options={"dump_dir": ...}``) if None; with
            neither, the last operations are printed to stderr.

    Returns:
        The file written, or None when it printed to stderr.
    """
    return dump(path or recorder.dump_dir, "on demand", last=None if path else 32)
