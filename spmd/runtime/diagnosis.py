"""The diagnosis of a timeout: ask the group's other ranks, over the control channel,
where they are, and say which have not reached the op and what they do instead; break
the group (a collective) and dump the flight recorder.  Also this rank's answer when a
peer asks the same."""

from __future__ import annotations

import time

from spmd.backends.checked import checking
from spmd.backends.mpi import faults
from spmd.core import flight_recorder
from spmd.core.context import GroupContext
from spmd.core.optable import is_p2p
from spmd.runtime import exits, failures, hangs
from spmd.runtime.abort import aborted_elsewhere, after_device_timeout
from spmd.runtime.group import world_state
from spmd.runtime.locations import where
from spmd.runtime.reliability import report, state

__all__ = ["answer", "diagnose", "diagnose_timeout", "group_key", "handle_timeout",
           "peer_text", "tell_broken", "who"]

_monotonic = time.monotonic


def _contexts() -> list[GroupContext]:
    return [pg.context for pg in list(world_state.groups)]


def group_key(g: GroupContext) -> dict:
    """How a peer finds ``g`` among its groups: name, members, and which of the groups
    with both it is (groups can share members and name)."""
    same = [x for x in _contexts() if x.name == g.name and x.ranks == g.ranks]
    index = next((i for i, x in enumerate(same) if x is g), 0)
    return {"name": g.name, "ranks": list(g.ranks), "index": index}


def find_group(key: dict) -> GroupContext | None:
    same = [x for x in _contexts() if x.name == key["name"] and list(x.ranks) == key["ranks"]]
    return same[key["index"]] if len(same) > key["index"] else None


def tell_broken(g: GroupContext, reason: str) -> None:
    """Tell ``g``'s other members that it broke on this rank (``GroupContext``'s notice:
    an op they are in, or reach later, then raises GroupBrokenError).

    Each member that answers has marked the group when this returns, so an op it starts
    afterwards raises, and can no longer complete against this rank's given-up one; one
    that does not answer within half a second (stopped, or holding the GIL) marks it
    when its control thread next runs."""
    ch = state.channel
    if ch is None:
        return
    me = g.ranks[g.rank]
    ch.query([r for r in g.ranks if r != me and r not in exits.exited],
             {"q": "broken", "group": group_key(g), "reason": reason, "from": me},
             min(state.config.query_timeout, hangs.QUERY_SECONDS))


def answer(request: dict) -> dict | None:
    """A peer asks where this rank is, or tells it something: a group broke (answered
    once marked), it exits, it aborts the job, or this rank was excluded as hung (runs
    on the control thread; a notice gets no answer)."""
    if request.get("q") == "excluded":
        hangs.excluded(request)
        return None
    if request.get("q") == "abort":
        aborted_elsewhere(request)
        return None
    if request.get("q") == "exited":
        exits.heard(int(request["from"]), str(request.get("text", "")))
        return None
    if request.get("q") == "broken":
        g = find_group(request["group"])
        if g is not None and g.error is None:
            g.mark_broken(f"{request['reason']} (told by rank {request['from']})",
                          tell_peers=False)
        return {}   # the sender waits for this: the group is marked here
    if request.get("q") != "state":
        return {"error": f"unknown query {request.get('q')!r}"}
    g = find_group(request["group"])
    # busy: in an spmd op on any group (a rank blocked there is a victim of a hang, not
    # its cause; see spmd.runtime.hangs).
    out: dict = {"where": where(), "busy": bool(flight_recorder.recorder.in_flight())}
    if g is None:
        out["no_group"] = True
        now = _monotonic()
        out["elsewhere"] = [flight_recorder.brief(e, now)
                            for e in flight_recorder.recorder.in_flight()][-3:]
    else:
        out.update(flight_recorder.recorder.group_summary(g, request.get("seq")))
        out["broken"] = g.error
        pending = checking.get(g)
        if pending is not None:  # in a debug-mode fingerprint exchange: it reached the op
            op, seq, t0 = pending
            b = {"op": op, "seq": seq, "kind": "collective", "group": g.name,
                 "state": "comparing arguments (debug mode)", "age": round(_monotonic() - t0, 3),
                 "took": None}
            out["seq"] = max(out["seq"], seq)
            out["current"] = [b] + out["current"]
            if request.get("seq") == seq:
                out["at_seq"] = b
    # Every rank that times out asks every other one: dump once per burst, not n times.
    if request.get("dump") and state.config.dump_dir and _monotonic() - state.dumped_at > 10.0:
        state.dumped_at = _monotonic()
        try:
            out["dump"] = flight_recorder.dump(
                state.config.dump_dir,
                f"asked by rank {request.get('from')}: {request.get('reason', '')}")
        except OSError as exc:
            out["dump"] = f"failed: {exc}"
    return out


def who(g: GroupContext, rank: int) -> str:
    r = g.group_rank(rank)
    return f"rank {rank}" if r == rank else f"rank {rank} (group rank {r})"


def _op_text(b: dict | None, here: str) -> str:
    if b is None:
        return "none"
    where = "" if b["group"] == here else f" on group {b['group']}"
    return f"{b['op']} #{b['seq']}{where}"


def peer_text(g: GroupContext, rank: int, rep: dict | None, target: int | None, op: str,
               kind: str = "collective") -> str:
    name = who(g, rank)
    if rank in exits.exited:
        return f"{name}: exited the program ({exits.exited[rank]})"
    if rep is None:
        return f"{name}: not responding (no answer on the control channel within " \
               f"{state.config.query_timeout:g} s: dead, or stuck without releasing the GIL)"
    if "error" in rep:
        return f"{name}: could not answer ({rep['error']})"
    parts = []
    if rep.get("no_group"):
        parts.append(f"has no group {g.name} (not created yet, or destroyed)")
    elif kind == "p2p":
        cur = [c for c in rep.get("current", []) if c["kind"] == "p2p"]
        parts.append(f"{rep.get('p2p_seq', 0)} point-to-point ops started on {g.name}; " +
                     ("in flight: " + ", ".join(f"{c['op']} #{c['seq']} (started {c['age']:.1f} "
                                                "s ago)" for c in cur) if cur else "none in flight"))
    else:
        last = rep.get("last")
        if last is not None:
            parts.append(f"last finished {_op_text(last, g.name)} "
                         f"{last['age'] - (last['took'] or 0):.1f} s ago")
        cur = [c for c in rep.get("current", []) if c["kind"] == "collective"]
        if last is None and rep.get("seq", 0) <= len(cur):
            parts.append(f"no collective on {g.name} finished yet")
        elif last is None:
            parts.append("its last finished collective is older than its flight recorder")
        parts.append("in flight here: " + ", ".join(
            f"{c['op']} #{c['seq']} (started {c['age']:.1f} s ago)" for c in cur)
            if cur else f"nothing in flight on {g.name}")
        at = rep.get("at_seq")
        if target is not None and at is not None and at["op"] != op:
            parts.append(f"MISMATCH: its #{target} is {at['op']}, not {op} (SPMD_DEBUG=DETAIL "
                         "checks every call)")
    for e in rep.get("elsewhere", []):
        parts.append(f"in flight on group {e['group']}: {e['op']} #{e['seq']} "
                     f"(started {e['age']:.1f} s ago)")
    parts.append(rep.get("where", "location unknown"))
    return f"{name}: " + "; ".join(parts)


# Where an operation that every rank reached is stuck, by the engine that runs it.
_STUCK_IN = {
    "MPI": "it is stuck inside MPI (a rank may be blocked in it by an op on another group)",
    "shared memory": "it is stuck inside the shared-memory engine (a rank may be blocked in "
                     "it by an op on another group)",
    "NCCL": "it is stuck inside NCCL on the GPU (a rank's stream may be blocked by earlier "
            "GPU work, or NCCL by an op on another communicator)",
}
_ALONE = {
    "NCCL": "this rank is the only member, and its GPU has not finished the operation: NCCL "
            "or GPU work queued before it on the stream is stuck",
}


# The kind of wait of a recovery's own steps (healing's spawn, joins and hand-over): the
# members are in no recorded op, and a silent one is taken for hung.
RECOVERY = "recovery"
# Periods of the group's timeout a recovery step waits past the first when every member
# answered and none is hung (spmd.backends.setup.run_blocking's patience): on a loaded
# node, Open MPI's agreement among processes that all wait in it was seen to take longer
# than a 3-s timeout.
RECOVERY_PATIENCE = 4


def diagnose(op: str, g: GroupContext, seq: int | None, kind: str, waited: float, source: str,
             engine: str = flight_recorder.MPI_ENGINE) -> str:
    """The text of a timeout: what this rank waited for on which engine, and where every
    other member is."""
    return _diagnosis(op, g, seq, kind, waited, engine)[0]


class _Found:
    """What a diagnosis found besides its text: the members holding a collective up
    (spmd.runtime.hangs.culprits) and their answers."""

    __slots__ = ("culprits", "replies")

    def __init__(self, culprits: list[int], replies: dict[int, dict]) -> None:
        self.culprits = culprits
        self.replies = replies


def _diagnosis(op: str, g: GroupContext, seq: int | None, kind: str, waited: float,
               engine: str) -> tuple[str, _Found]:
    me = g.ranks[g.rank]
    found = _Found([], {})
    what = "" if seq is None else \
        f"collective #{seq} " if kind == "collective" else f"point-to-point op #{seq} "
    lines = [(f"{op}: did not complete within {waited:.1f} s ({what}on group {g.name}, "
              f"{engine}, group timeout {g.timeout:g} s) [rank {g.rank}, group {g.name}]")]
    ch = state.channel
    peers = [r for r in g.ranks if r != me]
    if not peers:
        lines.append("  " + _ALONE.get(engine, "this rank is the only member; the operation "
                                               "can never complete"))
        return "\n".join(lines), found
    if ch is None or not ch.threaded:
        lines.append("  where the other ranks are is unknown: " +
                     ("no control channel runs yet (the world is starting)" if ch is None
                      else "the control channel needs MPI_THREAD_MULTIPLE"))
        if kind == RECOVERY and faults.ulfm():
            # Without answers: a member MPI knows to be dead (whose death the op did not
            # report: nobody revoked it yet), or whose process is stopped on this node.
            dead = [r for r in faults.known_failed(g) if r != me]
            stopped = [r for r in peers if r not in dead and hangs.stopped_here(r)]
            found.culprits = dead + stopped
            if dead:
                lines.append(f"  dead (MPI reports them failed): rank(s) {dead}")
            if stopped:
                lines.append(f"  stopped on this node: rank(s) {stopped}")
        return "\n".join(lines), found
    request = {"q": "state", "group": group_key(g), "seq": seq, "from": me,
               "dump": bool(state.config.dump_dir), "reason": f"{op} #{seq} timed out on rank {me}"}
    wait = state.config.query_timeout
    if faults.ulfm():   # the job can heal: a stopped rank's silence costs time to heal
        wait = min(wait, hangs.QUERY_SECONDS)
    replies = ch.query(peers, request, wait)
    found.replies = replies
    if kind == "collective" and seq is not None:
        found.culprits = hangs.culprits(peers, replies, seq)
        behind = [r for r in peers if r in replies and "error" not in replies[r]
                  and (replies[r].get("no_group") or replies[r].get("seq", 0) < seq)]
        silent = [r for r in peers if r not in replies or "error" in replies[r]]
        reached = [r for r in peers if r not in behind and r not in silent]
        other = [r for r in reached if (replies[r].get("at_seq") or {}).get("op", op) != op]
        if behind or silent:
            lines.append(f"  ranks that have not reached {op} #{seq}:"
                         if behind else "  ranks that did not say where they are:")
            for r in behind + silent:
                lines.append("    " + peer_text(g, r, replies.get(r), seq, op))
        elif other:
            lines.append(f"  every rank reached collective #{seq}, but not every rank called "
                         f"{op}: the ranks called different collectives")
        else:
            lines.append(f"  every rank reached {op} #{seq}; " +
                         _STUCK_IN.get(engine, f"it is stuck inside {engine}"))
        lines.append(f"  reached it: {who(g, me)} (this rank)" +
                     "".join(f", {who(g, r)}" for r in reached))
        for r in other:
            lines.append("    " + peer_text(g, r, replies[r], seq, op))
    else:
        if kind == RECOVERY:
            # Every live member is inside the same recovery step, outside any recorded op:
            # only those that do not answer at all hold it up.
            found.culprits = [r for r in peers if r not in replies or "error" in replies[r]]
        lines.append("  the other ranks:")
        for r in peers:
            lines.append("    " + peer_text(g, r, replies.get(r), None, op,
                                            "collective" if kind == RECOVERY else kind))
    return "\n".join(lines), found


def handle_timeout(op: str, g: GroupContext, seq: int | None, kind: str, waited: float, source: str,
                   engine: str = flight_recorder.MPI_ENGINE) -> str:
    """Diagnose, break the group (collectives), dump the flight recorder; the message."""
    return _handle(op, g, seq, kind, waited, source, engine)[0]


def _handle(op: str, g: GroupContext, seq: int | None, kind: str, waited: float, source: str,
            engine: str) -> tuple[str, list[int]]:
    """handle_timeout's work; also the hung members it ended (where the job can survive
    them: spmd.runtime.hangs)."""
    text, found = _diagnosis(op, g, seq, kind, waited, engine)
    ended: list[int] = []
    # Host engines only (MPI, shared memory): a hung member's process can be ended and the
    # op's host buffers are left alone; a device op's stream is the device policy's.
    if found.culprits and faults.ulfm() and engine != flight_recorder.NCCL_ENGINE:
        done = hangs.end(g, found.culprits, found.replies, f"{op} #{seq} on {g.name} timed out")
        ended = found.culprits
        text += (f"\n  this job survives failed ranks (ULFM): the hung rank(s) {ended} are "
                 f"ended so that MPI reports them failed: {done}")
    if kind == "collective" and g.error is None:
        # Ended hung members make the others' ops fail through MPI, and the survivors
        # agree on them: nobody to tell (and no answer to wait for from the ended).
        g.mark_broken(f"{op} #{seq} timed out on rank {state.rank} after {waited:.1f} s",
                      tell_peers=not ended)
        text += f"\n  group {g.name} is now broken: later calls on it raise GroupBrokenError"
    if kind != "collective" and source == "wait":
        return text, ended  # a receive can still complete: no dump for a polling wait(timeout)
    try:
        path = flight_recorder.dump(state.config.dump_dir, f"{op} #{seq} on {g.name} timed out")
    except OSError as exc:
        text += f"\n  flight recorder dump failed: {exc}"
    else:
        if path is not None:
            text += (f"\n  flight recorder dumps in {state.config.dump_dir}; merge them with "
                     f"python -m spmd.tools.fr_trace {state.config.dump_dir}")
    return text, ended


def diagnose_timeout(op: str, g: GroupContext, seq: int | None, kind: str, waited: float, source: str,
                      work) -> str | BaseException:
    """The one wait helper's hook: the diagnosis of any wait that timed out; or, where
    the hung members it found were ended and MPI reports them dead, the failure error
    the survivors agreed on (ProcessFailedError naming them)."""
    engine = flight_recorder.MPI_ENGINE
    if work is not None:
        engine = work.engine
        number = getattr(work, "flight_number", None)
        e = None if number is None else flight_recorder.recorder.entry(number)
        if e is not None:
            flight_recorder.recorder.mark_timed_out(e.number)
            seq, kind = e.seq, e.kind
        else:
            kind = "p2p" if is_p2p(op) else "collective"
    elif seq is None and kind == "collective":  # a wait before the op's Work exists
        seq = flight_recorder.next_seq(g)
    text, ended = _handle(op, g, seq, kind, waited, source, engine)
    if source != "wait":
        text += f"\n  (timed out {source})"
    if ended and hangs.await_failure(ended):
        report(text)
        return failures.on_failure(op, g)
    after_device_timeout(engine, op, seq, f"{op}: {text}")
    return text
