"""Debug mode's engine wrapper: every operation compares its fingerprint across the
group before it starts.

The wrapper is a real engine: one method per operation of the op table
(``spmd.optable``), each computing the op's fingerprint from the table, exchanging it
with the other ranks of the group on a private duplicate of the group's communicator,
and raising ``CollectiveMismatchError`` on every rank when they differ.  Point-to-point
operations are passed through (their peers are not the whole group).  Waits go through
the one wait helper, so a rank that never arrives ends in the usual diagnosis.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import weakref

import numpy as np

from .._wait import wait_until
from ..errors import CollectiveMismatchError
from ..flight_recorder import next_seq, ranks_text
from ..optable import OPS
from .base import DeviceBackend, install_op_methods

__all__ = ["CheckedBackend", "check_call", "checking"]

FP_BYTES = 1024   # one rank's fingerprint, JSON, zero-padded: one fixed-size all-gather

# Collectives waiting in a fingerprint exchange, by group: the control channel reports
# them, since no Work exists yet for the op they are about to start.
checking: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_SPMD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
            shown = [f"{_show(key, json.loads(v))} on {ranks_text(rs)}" for v, rs in parts]
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



# The private communicator each checked group compares fingerprints on.
_check_comms: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _wait(req, op: str, pg, seq: int, what: str) -> None:
    wait_until(req.Test, pg._timeout, op, pg, seq=seq, source=f"in debug mode, {what}")


def check_call(pg, op: str, fields: dict, pairs: dict | None = None) -> None:
    """Compare this call's fingerprint with the other ranks of ``pg``; raise
    CollectiveMismatchError on every rank where they differ.  Every member calls it."""
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
        comm = _check_comms.get(pg)
        if comm is None:
            comm, req = pg._comm.Idup()
            _wait(req, op, pg, seq, "creating the communicator that compares calls")
            comm.Set_name(f"spmd:debug:{pg._name}")
            _check_comms[pg] = comm
        _wait(comm.Iallgather(buf, rbuf), op, pg, seq, "comparing call fingerprints")
    finally:
        checking.pop(pg, None)
    records = [json.loads(bytes(row).rstrip(b"\0")) for row in rbuf]
    problems = compare(records, pg)
    if problems:
        sites: dict[str, list[int]] = {}
        for i, r in enumerate(records):
            sites.setdefault(r.get("site", "?"), []).append(pg._ranks[i])
        calls = "; ".join(f"{ranks_text(rs)} at {s}" for s, rs in
                          sorted(sites.items(), key=lambda kv: kv[1]))
        raise CollectiveMismatchError(
            f"{op}: ranks of group {pg._name} called collective #{seq} with different "
            f"arguments: " + "; ".join(problems) + f" [rank {pg._rank}, group {pg._name}]"
            f"\n  called from: {calls}")


def free_check_comm(pg) -> None:
    """Release the comparing communicator of ``pg`` (when the group is destroyed)."""
    comm = _check_comms.pop(pg, None)
    if comm is not None:
        comm.Free()


class CheckedBackend(DeviceBackend):
    """Wraps a group's engine: each collective compares fingerprints, then runs."""

    def __init__(self, inner: DeviceBackend):
        super().__init__(inner.group)
        self.inner = inner
        self.name = inner.name

    def shutdown(self) -> None:
        free_check_comm(self.group)
        self.inner.shutdown()

    def on_split(self, child, color: int, key: int) -> None:
        self.inner.on_split(child, color, key)

    def batch_p2p(self, ops):
        return self.inner.batch_p2p(ops)


def _checked_method(name: str):
    spec = OPS[name]

    def method(self, *args):
        if spec.fingerprint is not None:
            fields, pairs = spec.fingerprint(self.group, *args)
            check_call(self.group, name, fields, pairs)
        return getattr(self.inner, name)(*args)

    return method


install_op_methods(CheckedBackend, _checked_method,
                   "{name}, after comparing its fingerprint across the group.")
