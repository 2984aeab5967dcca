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
group's first operation), so set it before ``init_process_group`` or through it.

``monitored_barrier`` is a barrier that names the ranks that did not arrive.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import sys
import time
import weakref
import zlib

import numpy as np

from . import work as _work
from ._control import TAG_BARRIER
from .errors import CollectiveMismatchError, DistTimeoutError
from .flight_recorder import next_seq
from .group import _state, resolve

__all__ = [
    "DebugLevel",
    "get_debug_level",
    "monitored_barrier",
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


def set_debug_level(level) -> None:
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
    _state.wrap_backend = CheckedBackend if level >= DebugLevel.DETAIL else None


def set_debug_level_from_env() -> None:
    """Set the debug level from ``SPMD_DEBUG`` (OFF if unset)."""
    set_debug_level(os.environ.get("SPMD_DEBUG") or "OFF")


# ----------------------------------------------------------------------------- fingerprints

FP_BYTES = 1024   # one rank's fingerprint, JSON, zero-padded: one fixed-size all-gather

# Collectives waiting in a fingerprint exchange, by group: the control channel reports
# them, since no Work exists yet for the op they are about to start.
checking: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_SPMD_DIR = os.path.dirname(os.path.abspath(__file__))


def call_site() -> str:
    """``file:line`` of the innermost frame outside spmd."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_SPMD_DIR):
        f = f.f_back
    if f is None:
        return "?"
    name = f.f_code.co_filename
    try:
        rel = os.path.relpath(name)
        name = rel if not rel.startswith("..") else name
    except ValueError:
        pass
    return f"{name}:{f.f_lineno}"


def _encode(record: dict) -> bytes:
    data = json.dumps(record, separators=(",", ":")).encode()
    if len(data) <= FP_BYTES:
        return data
    # Long lists (many arrays, large groups) travel as digests: still compared exactly.
    fp = {k: ("sha1:" + hashlib.sha1(json.dumps(v).encode()).hexdigest()[:16]
              if isinstance(v, list) and len(json.dumps(v)) > 64 else v)
          for k, v in record["fp"].items()}
    pairs = record.get("pairs")
    if pairs is not None:
        pairs = {k: "sha1:" + hashlib.sha1(json.dumps(v).encode()).hexdigest()[:16]
                 for k, v in pairs.items()}
    data = json.dumps({"fp": fp, "pairs": pairs, "site": record["site"][-200:]},
                      separators=(",", ":")).encode()
    return data[:FP_BYTES]


def _ranks_text(ranks: list[int]) -> str:
    from .flight_recorder import ranks_text

    return ranks_text(ranks)


def _show(key: str, value) -> str:
    if value is None:
        return "none"
    if key in ("shape",) and isinstance(value, list):
        return str(tuple(value))
    if key == "shapes" and isinstance(value, list):
        return "[" + ", ".join(str(tuple(s)) for s in value) + "]"
    return str(value)


def compare(records: list[dict], pg) -> list[str]:
    """What differs between the ranks' fingerprints, one sentence per field."""
    fps = [r["fp"] for r in records]
    keys: list[str] = []
    for fp in fps:
        keys += [k for k in fp if k not in keys]
    problems = []
    for key in keys:
        groups: dict[str, list[int]] = {}
        for i, fp in enumerate(fps):
            groups.setdefault(json.dumps(fp.get(key)), []).append(pg._ranks[i])
        if len(groups) > 1:
            parts = sorted(groups.items(), key=lambda kv: kv[1])
            shown = [f"{_show(key, json.loads(v))} on {_ranks_text(rs)}" for v, rs in parts]
            label = "root (global rank)" if key == "root" else key
            problems.append(f"{label}: " + (" but ".join(shown) if len(shown) == 2
                                            else ", ".join(shown)))
        if key == "op" and problems:
            break  # different collectives: their other fields cannot be compared
    if problems:
        return problems
    pairs = [r.get("pairs") for r in records]
    if all(isinstance(p, dict) and isinstance(p.get("send"), list) for p in pairs):
        for i, p in enumerate(pairs):
            for j, count in enumerate(p["send"]):
                expect = pairs[j]["recv"][i]
                if count != expect:
                    problems.append(f"sizes: rank {pg._ranks[i]} sends {count} elements to rank "
                                    f"{pg._ranks[j]}, which expects {expect} from it")
    elif any(p is not None for p in pairs) and len({json.dumps(p) for p in pairs}) > 1 \
            and any(isinstance(p, dict) and isinstance(p.get("send"), str) for p in pairs):
        problems.append("sizes: the per-rank split sizes do not agree (too many to show)")
    return problems[:8]


class CheckedBackend:
    """Wraps a group's backend: each collective compares fingerprints, then runs.

    Point-to-point calls and anything else the backend offers pass through unchecked.
    """

    def __init__(self, inner):
        self.inner = inner
        self.group = inner.group
        self.name = inner.name
        self._comm = None      # private duplicate of the group's communicator

    def __getattr__(self, name):
        # Methods this wrapper does not check (p2p, backend extras) go to the backend.
        return getattr(self.inner, name)

    def shutdown(self) -> None:
        if self._comm is not None:
            self._comm.Free()
            self._comm = None
        self.inner.shutdown()

    # -- the exchange ------------------------------------------------------------

    def _wait(self, req, op: str, seq: int, what: str) -> None:
        pg = self.group
        start = time.monotonic()
        deadline = start + pg._timeout
        spins = 0
        while not req.Test():
            spins += 1
            if _work._oversubscribed:
                os.sched_yield()
            if not spins & 255 and time.monotonic() > deadline:
                from .watchdog import handle_timeout

                text = handle_timeout(op, pg, seq, "collective", time.monotonic() - start, what)
                raise DistTimeoutError(text + f"\n  (timed out in debug mode, {what})")

    def _check(self, op: str, fields: dict, pairs: dict | None = None) -> None:
        pg = self.group
        n = pg._size
        if n == 1:
            return
        seq = next_seq(pg)
        record = {"fp": {"op": op, "seq": seq, **fields}, "pairs": pairs, "site": call_site()}
        data = _encode(record)
        buf = np.zeros(FP_BYTES, np.uint8)
        buf[:len(data)] = np.frombuffer(data, np.uint8)
        rbuf = np.empty((n, FP_BYTES), np.uint8)
        checking[pg] = (op, seq, time.monotonic())
        try:
            if self._comm is None:
                comm, req = pg._comm.Idup()
                self._wait(req, op, seq, "creating the communicator that compares calls")
                comm.Set_name(f"spmd:debug:{pg._name}")
                self._comm = comm
            self._wait(self._comm.Iallgather(buf, rbuf), op, seq, "comparing call fingerprints")
        finally:
            checking.pop(pg, None)
        records = [json.loads(bytes(row).rstrip(b"\0")) for row in rbuf]
        problems = compare(records, pg)
        if problems:
            sites: dict[str, list[int]] = {}
            for i, r in enumerate(records):
                sites.setdefault(r.get("site", "?"), []).append(pg._ranks[i])
            calls = "; ".join(f"{_ranks_text(rs)} at {s}" for s, rs in
                              sorted(sites.items(), key=lambda kv: kv[1]))
            raise CollectiveMismatchError(
                f"{op}: ranks of group {pg._name} called collective #{seq} with different "
                f"arguments: " + "; ".join(problems) + f" [rank {pg._rank}, group {pg._name}]"
                f"\n  called from: {calls}")

    # -- collectives -------------------------------------------------------------

    def _root(self, root: int) -> int:
        return self.group._ranks[root]

    def broadcast(self, a, root):
        self._check("broadcast", {"dtype": a.dtype.name, "shape": list(a.shape),
                                  "root": self._root(root)})
        return self.inner.broadcast(a, root)

    def all_reduce(self, a, op):
        self._check("all_reduce", {"dtype": a.dtype.name, "shape": list(a.shape),
                                   "reduce_op": _opname(op)})
        return self.inner.all_reduce(a, op)

    def all_reduce_coalesced(self, tensors, op):
        self._check("all_reduce_coalesced", {"dtypes": [t.dtype.name for t in tensors],
                                             "shapes": [list(t.shape) for t in tensors],
                                             "reduce_op": _opname(op)})
        return self.inner.all_reduce_coalesced(tensors, op)

    def reduce(self, a, root, op):
        self._check("reduce", {"dtype": a.dtype.name, "shape": list(a.shape),
                               "root": self._root(root), "reduce_op": _opname(op)})
        return self.inner.reduce(a, root, op)

    def all_gather(self, outputs, a):
        self._check("all_gather", {"dtype": a.dtype.name, "sizes": [o.size for o in outputs]})
        return self.inner.all_gather(outputs, a)

    def all_gather_into_tensor(self, out, a):
        self._check("all_gather_into_tensor", {"dtype": a.dtype.name, "shape": list(a.shape)})
        return self.inner.all_gather_into_tensor(out, a)

    def all_gather_coalesced(self, output_lists, inputs):
        self._check("all_gather_coalesced", {"dtypes": [x.dtype.name for x in inputs],
                                             "shapes": [list(x.shape) for x in inputs]})
        return self.inner.all_gather_coalesced(output_lists, inputs)

    def gather(self, a, outputs, root):
        self._check("gather", {"dtype": a.dtype.name, "shape": list(a.shape),
                               "root": self._root(root)})
        return self.inner.gather(a, outputs, root)

    def scatter(self, out, inputs, root):
        self._check("scatter", {"dtype": out.dtype.name, "shape": list(out.shape),
                                "root": self._root(root)})
        return self.inner.scatter(out, inputs, root)

    def reduce_scatter(self, out, inputs, op):
        self._check("reduce_scatter", {"dtype": out.dtype.name,
                                       "sizes": [x.size for x in inputs],
                                       "reduce_op": _opname(op)})
        return self.inner.reduce_scatter(out, inputs, op)

    def reduce_scatter_tensor(self, out, a, op):
        self._check("reduce_scatter_tensor", {"dtype": a.dtype.name, "shape": list(a.shape),
                                              "reduce_op": _opname(op)})
        return self.inner.reduce_scatter_tensor(out, a, op)

    def all_to_all(self, outputs, inputs):
        self._check("all_to_all", {"dtype": outputs[0].dtype.name},
                    {"send": [x.size for x in inputs], "recv": [o.size for o in outputs]})
        return self.inner.all_to_all(outputs, inputs)

    def all_to_all_single(self, out, a, output_counts, input_counts):
        n = self.group._size
        send = list(input_counts) if input_counts is not None else [a.size // n] * n
        recv = list(output_counts) if output_counts is not None else [out.size // n] * n
        self._check("all_to_all_single", {"dtype": a.dtype.name}, {"send": send, "recv": recv})
        return self.inner.all_to_all_single(out, a, output_counts, input_counts)

    def barrier(self):
        self._check("barrier", {})
        return self.inner.barrier()


def _opname(op) -> str:
    return getattr(op, "name", None) or repr(op)


# ----------------------------------------------------------------------------- monitored barrier

_barrier_counts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False) -> None:
    """A barrier that says which ranks did not arrive.

    Group rank 0 waits for every other member's arrival (over the control channel, not
    the group's communicator, so it works even when the group is out of step) and then
    releases them.  Every member must call it.

    Args:
        timeout: how long rank 0 waits for the others (the group's timeout if None).
        wait_all_ranks: name every missing rank, not only the first one.

    Raises:
        DistTimeoutError: on group rank 0, naming the missing rank(s) and where they are;
            on the other ranks, with rank 0's verdict (or when rank 0 does not answer).
    """
    from . import watchdog

    op = "monitored_barrier"
    pg = resolve(group, op)
    if pg is None or pg._size == 1:
        return
    seconds = pg._timeout if timeout is None else _work._seconds(timeout)
    ch = watchdog._rt.channel
    if ch is None:
        raise RuntimeError(f"{op}: the control channel is not running [rank {pg._rank}, "
                           f"group {pg._name}]")
    count = _barrier_counts.get(pg, 0) + 1
    _barrier_counts[pg] = count
    arrive = TAG_BARRIER + 2 * (zlib.crc32(f"{pg._name}{pg._ranks}".encode()) % 4096)
    root, me = pg._ranks[0], pg._ranks[pg._rank]
    if me != root:
        ch.send({"count": count}, root, arrive)
        deadline = time.monotonic() + seconds + watchdog.config().query_timeout + 5.0
        while time.monotonic() < deadline:
            msg = ch.receive(root, arrive + 1)
            if msg is None:
                time.sleep(0.001)
            elif msg["count"] == count:
                if msg.get("error"):
                    raise DistTimeoutError(msg["error"].replace(
                        f"[rank 0, group {pg._name}]", f"[rank {pg._rank}, group {pg._name}]"))
                return
        text = watchdog.diagnose(op, pg, None, "barrier", seconds, "monitored_barrier")
        raise DistTimeoutError(f"{op}: {watchdog._who(pg, root)}, which runs the barrier, did "
                               f"not release this rank [rank {pg._rank}, group {pg._name}]\n"
                               + "\n".join(text.splitlines()[1:]))
    pending = list(pg._ranks[1:])
    deadline = time.monotonic() + seconds
    while pending and time.monotonic() < deadline:
        for r in list(pending):
            msg = ch.receive(r, arrive)
            while msg is not None and msg["count"] < count:  # left by an earlier failure
                msg = ch.receive(r, arrive)
            if msg is not None:
                pending.remove(r)
        if pending:
            time.sleep(0.001)
    error = None
    if pending:
        named = pending if wait_all_ranks else pending[:1]
        request = {"q": "state", "group": watchdog.group_key(pg), "seq": None, "from": me,
                   "dump": False}
        replies = ch.query(named, request, watchdog.config().query_timeout)
        who = ", ".join(watchdog._who(pg, r) for r in named)
        more = "" if wait_all_ranks or len(pending) == 1 else \
            f" (and {len(pending) - 1} more; wait_all_ranks=True names them all)"
        error = (f"{op}: {who} did not arrive within {seconds:g} s{more} "
                 f"[rank 0, group {pg._name}]\n" +
                 "\n".join("  " + watchdog._peer_text(pg, r, replies.get(r), None, op)
                           for r in named))
    for r in pg._ranks[1:]:
        ch.send({"count": count, "error": error}, r, arrive + 1)
    if error is not None:
        raise DistTimeoutError(error)
    return
