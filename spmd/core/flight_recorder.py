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

import contextlib
import itertools
import json
import os
import socket
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from typing import Any

from spmd.core.context import GroupContext
from spmd.core.lines import write_lines
from spmd.core.optable import P2P_OPS

__all__ = ["Entry", "FlightRecorder", "Ring", "dump_flight_recorder", "recorder",
           "write_private"]

_monotonic = time.monotonic

MPI_ENGINE = "MPI"
NCCL_ENGINE = "NCCL"   # its blocking calls return when enqueued, before the op completes
STARTED, COMPLETED = "started", "completed"
KINDS = ("collective", "p2p")     # a group's op_counters, in this order

FORMAT = "spmd-flight-recorder"
VERSION = 1
DEFAULT_SIZE = 2048

IN_FLIGHT = -1.0                  # a slot's end time while its op runs
WRITING = -2.0                    # ... while begin() fills it (readers skip it)
FAILED, TIMED_OUT, P2P, RANK_DIED = 1, 2, 4, 8  # bits of a slot's flags
RANK_DIED_STATE = "failed: a rank died"


class Entry:
    """One recorded operation, as the readers of the recorder see it.

    Made from the ring when something reads it (``entries()``, a dump, the watchdog, a
    diagnosis), never on the hot path; a change a reader makes goes back through
    :meth:`FlightRecorder.mark_timed_out` and :meth:`FlightRecorder.settle`.

    Attributes:
        number: the operation's number in this process (what a Work keeps).
        op: the operation's name.
        group: the group it runs on.
        seq: its number among its group's operations of its kind.
        kind: ``"collective"`` or ``"p2p"`` (each numbered on its own, as c10d does).
        size: element count of its first array (None: no array).
        dtype: that array's dtype (None: no array).
        t0: start, ``time.monotonic()``.
        t1: end; None while in flight.
        failed: whether it ended with an error.
        rank_died: whether that error was a member's death (ULFM), not a timeout.
        timed_out: whether a timeout was reported for it (once is enough).
        engine: what runs it ("MPI", "shared memory", "NCCL").
        device: for an operation that ends on a GPU stream, (communicator, end event):
            it is over when the event has passed, whether or not anyone polled its
            Work, so whatever judges "in flight" asks the event first.
    """

    __slots__ = ("number", "op", "group", "seq", "kind", "size", "dtype", "t0", "t1",
                 "failed", "rank_died", "timed_out", "engine", "device")

    def __init__(self, ring: Ring, i: int):
        self.number: int = ring.numbers[i]
        self.op: str = ring.ops[i]
        self.group: GroupContext = ring.groups[i]
        self.seq: int = ring.seqs[i]
        self.t0: float = ring.t0[i]
        self.engine: str = ring.engines[i]
        size, t1, flags = ring.sizes[i], ring.t1[i], ring.flags[i]
        self.size = None if size < 0 else size
        self.dtype = ring.dtypes[i]
        self.t1 = None if t1 == IN_FLIGHT else t1
        self.kind = KINDS[1] if flags & P2P else KINDS[0]
        self.failed, self.timed_out = bool(flags & FAILED), bool(flags & TIMED_OUT)
        self.rank_died = bool(flags & RANK_DIED)
        self.device = ring.devices[i]

    def state(self) -> str:
        """started, completed, failed, or failed because a rank died."""
        if self.t1 is None:
            return STARTED
        if self.rank_died:
            return RANK_DIED_STATE
        return "failed" if self.failed else COMPLETED

    def __repr__(self) -> str:
        return f"<Entry {self.op} #{self.seq} on {self.group.name}: {self.state()}>"


class Ring:
    """The recorder's storage: one preallocated column per field, a slot per operation.

    Operation ``n`` (numbers drawn from ``numbers``, shared by every writer) lives in
    slot ``n % capacity`` until operation ``n + capacity`` takes it.  The Python path
    writes the columns by index, the compiled call path through their buffers
    (``columns()``, handed over by name); nothing is allocated per operation.
    """

    __slots__ = ("capacity", "numbers", "next_number", "ops", "groups", "seqs", "sizes",
                 "dtypes", "t0", "t1", "flags", "engines", "devices")

    def __init__(self, capacity: int):
        self.capacity = capacity
        # itertools.count: each number is drawn once, also by concurrent threads.
        self.next_number = itertools.count()
        self.numbers = array("q", [-1]) * capacity      # -1: a slot never used
        self.ops: list[Any] = [None] * capacity         # str once used
        self.groups: list[Any] = [None] * capacity
        self.seqs = array("q", [0]) * capacity
        self.sizes = array("q", [-1]) * capacity        # -1: no array
        self.dtypes: list[Any] = [None] * capacity
        self.t0 = array("d", [0.0]) * capacity
        self.t1 = array("d", [0.0]) * capacity          # IN_FLIGHT while running
        self.flags = array("B", [0]) * capacity
        self.engines: list[Any] = [None] * capacity     # str once used
        self.devices: list[Any] = [None] * capacity

    def columns(self) -> dict[str, Any]:
        """Every column by its name: what the compiled call path writes."""
        return {name: getattr(self, name) for name in Ring.__slots__}

    def read(self, i: int) -> Entry | None:
        """Slot ``i`` as an Entry; None if it is empty or being written meanwhile.

        begin() marks a slot WRITING before it fills it, so a reader on another thread
        (the watchdog) never takes one operation's start time for another's."""
        if self.t1[i] == WRITING:
            return None
        number = self.numbers[i]
        if number < 0:
            return None
        e = Entry(self, i)
        return e if self.numbers[i] == number and self.t1[i] != WRITING else None

    def slot(self, number: int) -> int:
        """The slot of operation ``number``; -1 once another operation took it."""
        i = number % self.capacity
        return i if self.numbers[i] == number else -1


def ring_size(requested: int) -> int:
    """The ring's real size: at least 16 entries."""
    return max(16, int(requested))


def counters(group: GroupContext) -> tuple[int, int]:
    """(collectives, point-to-point operations) started on ``group``."""
    c = group.op_counters
    return c[0], c[1]


def next_seq(group: GroupContext) -> int:
    """The sequence number the next collective on ``group`` will get."""
    return group.op_counters[0] + 1


class FlightRecorder:
    """The Work observer that keeps the ring; one per process (``recorder``)."""

    def __init__(self, size: int = DEFAULT_SIZE):
        # Told the new ring on every resize: the compiled call path holds its columns.
        self.listeners: list[Callable[[Ring], None]] = []
        self.resize(size)
        # Set by the reliability layer at init: () -> (WORLD, every live group), for the
        # dump's group table; and where dumps go by default (None: stderr).
        self.groups_source: Callable[[], tuple[GroupContext | None, list[GroupContext]]] = \
            lambda: (None, [])
        self.dump_dir: str | None = None

    def resize(self, size: int) -> None:
        self.ring = Ring(ring_size(size))
        # In-flight operations whose slot a newer one took: number -> Entry.
        self.stale: dict[int, Entry] = {}
        for listener in self.listeners:
            listener(self.ring)

    @property
    def size(self) -> int:
        return self.ring.capacity

    # -- the hot path: called for every Work --------------------------------------

    def begin(self, op: str, g: GroupContext, a, engine: str = MPI_ENGINE) -> int:
        """Record ``op`` starting on group ``g`` (``a``: its first array, or None) on
        ``engine``; return its number, which :meth:`end` completes."""
        r = self.ring
        n = next(r.next_number)
        i = n % r.capacity
        if r.t1[i] == IN_FLIGHT:
            self.push_out(i)
        r.t1[i] = WRITING
        kind = P2P if op in P2P_OPS else 0
        counts = g.op_counters
        k = 1 if kind else 0
        counts[k] = seq = counts[k] + 1
        r.numbers[i], r.ops[i], r.groups[i], r.seqs[i] = n, op, g, seq
        if a is None:
            r.sizes[i], r.dtypes[i] = -1, None
        else:
            r.sizes[i], r.dtypes[i] = a.size, a.dtype
        r.flags[i], r.engines[i], r.devices[i] = kind, engine, None
        r.t0[i] = _monotonic()
        r.t1[i] = IN_FLIGHT     # last: the slot is whole
        return n

    def end(self, number: int, failed: bool = False) -> None:
        """Mark operation ``number`` (from :meth:`begin`) completed; a device op seen
        finished already keeps its first end time."""
        r = self.ring
        i = number % r.capacity
        if r.numbers[i] == number:
            if r.t1[i] == IN_FLIGHT:
                r.t1[i] = _monotonic()
            if failed:
                r.flags[i] |= FAILED
            return
        e = self.stale.pop(number, None)   # pushed out of the ring while in flight
        if e is not None and failed:
            e.failed = True

    def push_out(self, i: int) -> None:
        """Slot ``i`` holds an operation still in flight and a new one needs it: keep
        the old one as an Entry (the compiled call path calls this too)."""
        e = Entry(self.ring, i)   # (the writer is this thread: whole)
        if e.device is not None:
            self.settle((e,))
        if e.t1 is None:
            self.stale[e.number] = e

    def started(self, work) -> None:
        try:
            a = work.outputs[0]
            a.size  # noqa: B018 - an array, not a list of lists
        except (TypeError, IndexError, AttributeError):  # no outputs, or a list of lists
            a = None
        n = work.flight_number = self.begin(work.op, work.group, a, work.engine)
        device_end = work.device_end
        if device_end is not None:
            self.ring.devices[n % self.ring.capacity] = device_end

    def completed(self, work) -> None:
        try:
            n = work.flight_number
        except AttributeError:  # started before the recorder was registered
            return
        self.end(n, work.error is not None)

    def mark_timed_out(self, number: int) -> None:
        """A timeout was reported for operation ``number`` (the watchdog reports it no
        more)."""
        i = self.ring.slot(number)
        if i >= 0:
            self.ring.flags[i] |= TIMED_OUT
        elif number in self.stale:
            self.stale[number].timed_out = True

    def mark_rank_died(self, group: GroupContext) -> None:
        """Members of ``group`` died: its operations in flight end here, failed because
        of that (the watchdog reports no timeout for them)."""
        r = self.ring
        for e in self.in_flight():
            if e.group is group:
                i = r.slot(e.number)
                if i >= 0:
                    r.flags[i] |= FAILED | RANK_DIED
                    r.t1[i] = _monotonic()
                else:   # pushed out of the ring while in flight: it ends here
                    stale = self.stale.pop(e.number, None)
                    if stale is not None:
                        stale.t1 = _monotonic()

    def entry(self, number: int) -> Entry | None:
        """Operation ``number`` as an Entry; None once it left the recorder."""
        i = self.ring.slot(number)
        return self.ring.read(i) if i >= 0 else self.stale.get(number)

    def seq_of(self, number: int) -> int | None:
        """The sequence number of operation ``number`` in its group (None once it left
        the recorder)."""
        i = self.ring.slot(number)
        if i >= 0:
            return self.ring.seqs[i]
        e = self.stale.get(number)
        return None if e is None else e.seq

    def settle(self, entries) -> None:
        """Mark finished the device operations among ``entries`` whose end event has
        passed (the end time is when this is first seen).  Never blocks."""
        r = self.ring
        for e in entries:
            device = e.device
            if device is not None and e.t1 is None and device[0].event_passed(device[1]):
                e.t1 = t = _monotonic()
                i = r.slot(e.number)
                if i >= 0 and r.t1[i] == IN_FLIGHT:
                    r.t1[i] = t
                elif e.number in self.stale:
                    del self.stale[e.number]

    # -- queries (watchdog, control channel, dumps): never on the hot path --------

    def entries(self) -> list[Entry]:
        """Every recorded entry, oldest first (in-flight ones pushed out of the ring too),
        device operations settled first."""
        r = self.ring
        numbers = list(r.numbers)
        ring = [e for e in map(r.read, sorted(range(r.capacity), key=numbers.__getitem__))
                if e is not None]
        stale = sorted(self.stale.values(), key=lambda e: e.number)
        self.settle(stale)
        self.settle(ring)
        return [e for e in stale if e.t1 is None] + ring

    def in_flight(self) -> list[Entry]:
        """Entries of operations that have started and not completed, oldest first."""
        return [e for e in self.entries() if e.t1 is None]

    def group_summary(self, group: GroupContext, seq: int | None = None) -> dict:
        """Where this process is on ``group``: counts, last finished and current ops."""
        coll_count, p2p_count = counters(group)
        now = _monotonic()
        entries = self.entries()
        mine = [e for e in entries if e.group is group]
        coll = [e for e in mine if e.kind == "collective"]
        done = [e for e in coll if e.t1 is not None]
        last = max(done, key=lambda e: e.seq) if done else None
        out = {
            "seq": coll_count,
            "p2p_seq": p2p_count,
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
                "seq": coll, "p2p_seq": p2p,
                "broken": g.error,
            }
        entries = []
        for i, e in enumerate(self.entries()):
            g = e.group
            entries.append({
                "id": i, "op": e.op, "group": g.name, "group_id": _group_id(g),
                "kind": e.kind, "seq": e.seq,
                "size": e.size if isinstance(e.size, int) else None,
                "dtype": _dtype_name(e.dtype),
                "start": round(e.t0 - now_mono + now_wall, 6),
                "end": round(e.t1 - now_mono + now_wall, 6) if e.t1 is not None else None,
                "state": e.state(), "timed_out": e.timed_out, "engine": e.engine,
            })
        return {
            "format": FORMAT, "version": VERSION, "reason": reason,
            # (-1 and 0 before init_process_group: no group, no rank yet)
            "rank": world.rank if world is not None else -1,
            "world_size": world.size if world is not None else 0,
            "host": socket.gethostname(), "pid": os.getpid(), "dumped_at": now_wall,
            "capacity": self.size, "groups": groups, "entries": entries,
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
    return {"op": e.op, "seq": e.seq, "kind": e.kind, "group": e.group.name,
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
    reader never sees half a file (a job being aborted may kill the writer).  The
    temporary file gets an unguessable name and is created by ``mkstemp`` (``O_CREAT |
    O_EXCL | O_NOFOLLOW``, mode 0600): in a directory others can write, a file or link
    planted at a name we would use is never opened, truncated or followed."""
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            fd = -1
            f.write(text)
        os.replace(tmp, path)  # replaces a link at `path` itself, never its target
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
