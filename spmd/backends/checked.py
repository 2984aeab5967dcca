"""Debug mode's engine wrapper: every operation compares its fingerprint across the
group before it starts.

The wrapper is a real engine: one method per operation of the op table
(``spmd.core.optable``), each computing the op's fingerprint from the table, exchanging it
with the other ranks of the group on a private duplicate of the group's communicator,
and raising ``CollectiveMismatchError`` on every rank when they differ.  Point-to-point
operations are passed through (their peers are not the whole group).  Waits go through
the one wait helper, so a rank that never arrives ends in the usual diagnosis.

Operations that run outside the engines (object collectives, persistent plans, the
collective operations of MPMD links) call :func:`check_call` or
:func:`check_op` (or :func:`check_link_call`) themselves, guarded by one truth test
of ``active``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import weakref
from collections.abc import Sequence
from types import FrameType
from typing import Any

import numpy as np
from mpi4py import MPI

from spmd.backends.base import Engine, install_op_methods
from spmd.backends.mpi import orphans
from spmd.backends.mpi.faults import failure
from spmd.core.context import GroupContext
from spmd.core.errors import CollectiveMismatchError
from spmd.core.flight_recorder import next_seq, ranks_text
from spmd.core.optable import OPS
from spmd.core.wait import wait_until

__all__ = ["CheckedEngine", "active", "check_call", "check_link_call", "check_op", "checking"]

FP_BYTES = 1024   # one rank's fingerprint, JSON, zero-padded: one fixed-size all-gather

# Collectives waiting in a fingerprint exchange, by group: the control channel reports
# them, since no Work exists yet for the op they are about to start.
checking: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Debug level DETAIL is on (set by spmd.runtime.debug.set_debug_level).  Operations outside the
# engines test it before checking, so with debug mode off they pay one truth test.
active = False

_SPMD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def call_site() -> str:
    """``file:line`` of the innermost frame outside spmd."""
    f: FrameType | None = sys._getframe(1)
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


def compare(records: list[dict], ranks: Sequence[int]) -> list[str]:
    """What differs between the ranks' fingerprints, one sentence per field (``records[i]``
    came from global rank ``ranks[i]``)."""
    fps = [r["fp"] for r in records]
    keys: list[str] = []
    for fp in fps:
        keys += [k for k in fp if k not in keys]
    problems = []
    for key in keys:
        groups: dict[str, list[int]] = {}
        for i, fp in enumerate(fps):
            groups.setdefault(json.dumps(fp.get(key)), []).append(ranks[i])
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
    pairs: list[Any] = [r.get("pairs") for r in records]  # decoded JSON
    if all(isinstance(p, dict) and isinstance(p.get("send"), list) for p in pairs):
        for i, p in enumerate(pairs):
            for j, count in enumerate(p["send"]):
                expect = pairs[j]["recv"][i]
                if count != expect:
                    problems.append(f"sizes: rank {ranks[i]} sends {count} elements to rank "
                                    f"{ranks[j]}, which expects {expect} from it")
    elif any(p is not None for p in pairs) and len({json.dumps(p) for p in pairs}) > 1 \
            and any(isinstance(p, dict) and isinstance(p.get("send"), str) for p in pairs):
        problems.append("sizes: the per-rank split sizes do not agree (too many to show)")
    return problems[:8]



# The private communicator each checked group compares fingerprints on.
_check_comms: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _wait(req, op: str, ctx: GroupContext, seq: int, what: str) -> None:
    _wait_all([req], op, ctx, seq, what)


def check_call(ctx: GroupContext, op: str, fields: dict, pairs: dict | None = None) -> None:
    """Compare this call's fingerprint with the other ranks of ``ctx``; raise
    CollectiveMismatchError on every rank where they differ.  Every member calls it."""
    n = ctx.size
    if n == 1:
        return
    seq = next_seq(ctx)
    record = {"fp": {"op": op, "seq": seq, **fields}, "pairs": pairs, "site": call_site()}
    data = _encode(record)
    buf = np.zeros(FP_BYTES, np.uint8)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    rbuf = np.empty((n, FP_BYTES), np.uint8)
    checking[ctx] = (op, seq, time.monotonic())
    try:
        comm = _check_comms.get(ctx)
        if comm is None:
            comm, req = ctx.comm.Idup()
            _wait(req, op, ctx, seq, "creating the communicator that compares calls")
            comm.Set_name(f"spmd:debug:{ctx.name}")
            _check_comms[ctx] = comm
        _wait(comm.Iallgather(buf, rbuf), op, ctx, seq, "comparing call fingerprints")
    finally:
        checking.pop(ctx, None)
    records = [json.loads(bytes(row).rstrip(b"\0")) for row in rbuf]
    problems = compare(records, ctx.ranks)
    if problems:
        calls = _sites(records, list(ctx.ranks))
        raise CollectiveMismatchError(
            f"{op}: ranks of group {ctx.name} called collective #{seq} with different "
            f"arguments: " + "; ".join(problems) + f" [rank {ctx.rank}, group {ctx.name}]"
            f"\n  called from: {calls}")


def check_op(ctx: GroupContext, op: str, *args) -> None:
    """:func:`check_call` with ``op``'s fingerprint from the op table, computed from
    ``args`` (the arguments its table entry names).  Every member of ``ctx`` calls it."""
    fingerprint = OPS[op].fingerprint
    assert fingerprint is not None, f"{op} has no fingerprint in the op table"
    fields, pairs = fingerprint(ctx, *args)
    check_call(ctx, op, fields, pairs)


def check_comms(ctx: GroupContext) -> tuple:
    """The communicators debug mode compares calls of ``ctx`` on (revoked with the group
    when a member dies)."""
    comm = _check_comms.get(ctx)
    return comm if isinstance(comm, tuple) else (() if comm is None else (comm,))


def free_check_comm(ctx: GroupContext) -> None:
    """Release the comparing communicator(s) of ``ctx`` (when the group is destroyed)."""
    comm = _check_comms.pop(ctx, None)
    for c in comm if isinstance(comm, tuple) else (comm,):
        if c is not None:
            c.Free()
    _link_seqs.pop(ctx, None)


# A link's checked calls, numbered on the link (both programs count the same calls).
_link_seqs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_link_call(ctx: GroupContext, local_comm, remote_ranks, op: str, fields: dict) -> None:
    """Compare this call's fingerprint with every rank of both programs of a link;
    raise CollectiveMismatchError on every rank of both where they differ.

    Every rank of both programs calls it.  The program's ranks gather their records on
    a duplicate of ``local_comm``, the two programs' rank 0s swap them over a duplicate
    of the intercommunicator ``ctx.comm``, and each rank 0 broadcasts the other
    program's records to its ranks: only intracommunicator collectives and
    point-to-point messages, so it works wherever links do.

    Args:
        ctx: the link's group (its intercommunicator, this program's world ranks).
        local_comm: this program's ranks (an intracommunicator).
        remote_ranks: the other program's world ranks, in its rank order.
        op: the operation's name; fields: its fingerprint.
    """
    seq = _link_seqs.get(ctx, 0) + 1
    _link_seqs[ctx] = seq
    record = {"fp": {"op": op, "seq": seq, **fields}, "pairs": None, "site": call_site()}
    data = _encode(record)
    buf = np.zeros(FP_BYTES, np.uint8)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    mine = np.empty((ctx.size, FP_BYTES), np.uint8)
    theirs = np.empty((len(remote_ranks), FP_BYTES), np.uint8)
    checking[ctx] = (op, seq, time.monotonic())
    try:
        comms = _check_comms.get(ctx)
        if comms is None:
            inter, r1 = ctx.comm.Idup()
            local, r2 = local_comm.Idup()
            _wait_all([r1, r2], op, ctx, seq, "creating the communicators that compare calls")
            inter.Set_name(f"spmd:debug:{ctx.name}")
            _check_comms[ctx] = comms = (inter, local)
        inter, local = comms
        _wait(local.Iallgather(buf, mine), op, ctx, seq, "comparing call fingerprints")
        if ctx.rank == 0:
            reqs = [inter.Isend(mine, 0, 0), inter.Irecv(theirs, 0, 0)]
            _wait_all(reqs, op, ctx, seq, "comparing call fingerprints with the other program")
        _wait(local.Ibcast(theirs, 0), op, ctx, seq, "comparing call fingerprints")
    finally:
        checking.pop(ctx, None)
    # Both programs list the records in the same order (lower world ranks first), so
    # every rank of both computes, and raises, the same thing.
    blocks = [(list(ctx.ranks), mine), (list(remote_ranks), theirs)]
    blocks.sort(key=lambda b: b[0][0])
    ranks = blocks[0][0] + blocks[1][0]
    records = [json.loads(bytes(row).rstrip(b"\0")) for _, rows in blocks for row in rows]
    problems = compare(records, ranks)
    if problems:
        raise CollectiveMismatchError(
            f"{op}: the ranks of link {ctx.name} called link operation #{seq} with "
            f"different arguments: " + "; ".join(problems) + " (ranks are world ranks)"
            f" [rank {ctx.rank}, group {ctx.name}]\n  called from: "
            + _sites(records, ranks))


def _sites(records: list[dict], ranks: list[int]) -> str:
    sites: dict[str, list[int]] = {}
    for rank, r in zip(ranks, records):
        sites.setdefault(r.get("site", "?"), []).append(rank)
    return "; ".join(f"{ranks_text(rs)} at {s}" for s, rs in
                     sorted(sites.items(), key=lambda kv: kv[1]))


def _wait_all(reqs, op: str, ctx: GroupContext, seq: int, what: str) -> None:
    try:
        wait_until(lambda: MPI.Request.Testall(reqs), ctx.timeout, op, ctx, seq=seq,
                   source=f"in debug mode, {what}")
    except BaseException:
        # mpi4py's requests reference their buffers: held, they outlive this frame.
        orphans.hold([r for r in reqs if r], None)
        raise


class CheckedEngine(Engine):
    """Wraps a group's engine: each collective compares fingerprints, then runs."""

    def __init__(self, inner: Engine):
        super().__init__(inner.group)
        self.inner = inner
        self.name = inner.name

    def failure(self, exc: Exception, op: str) -> BaseException:
        return failure(exc, op, self.group)

    def shutdown(self) -> None:
        free_check_comm(self.group)
        self.inner.shutdown()

    def abort(self) -> None:
        _check_comms.pop(self.group, None)   # not freed: a member may be dead
        self.inner.abort()

    def on_split(self, child: GroupContext | None, color: int, key: int) -> None:
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


install_op_methods(CheckedEngine, _checked_method,
                   "{name}, after comparing its fingerprint across the group.")
