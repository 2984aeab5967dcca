"""A hung rank becomes a failed rank, where the job can survive one (ULFM).

A rank that stops answering (stopped, looping, stuck in a driver) is alive to MPI, so
ULFM never reports it: only the group's timeout sees it.  When a collective times out in
a job that survives dead ranks, the diagnosis names the members that hold it up
(:func:`culprits`): those that did not answer the control channel at all, and those that
answered but have not reached the op and wait for nothing of spmd's (their main thread
is elsewhere: computing, looping).  A member that is itself blocked in another spmd op
is a victim, not a culprit.  Each survivor that timed out then ends them (:func:`end`):

- a culprit that answered is told it was excluded; its control thread ends its process;
- a culprit on this rank's node is killed by its pid (a stopped process cannot act),
  the pids and hosts having been gathered at start-up (:func:`learn_peers`);
- one on another node, silent, is left to the survivors on its node (each survivor that
  timed out does the same), or, failing those, to the launcher.

MPI then reports them dead (:func:`await_failure`), and from there it is the dead-rank
path: the survivors agree, every survivor raises ProcessFailedError naming them, and
``shrink_group`` and healing work as for a killed rank.  Without ULFM nothing is ended:
the diagnosis stands and the job ends, as a hung job always did.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time

from spmd.backends.mpi import faults, job
from spmd.core.context import GroupContext
from spmd.runtime.group import world_state
from spmd.runtime.reliability import report, state

__all__ = ["QUERY_SECONDS", "await_failure", "culprits", "end", "end_excluded", "excluded",
           "learn_peers", "pids_on_this_node", "renumber", "stopped_here"]

# How long the diagnosis of a job that survives hangs waits for a member's answer: a
# stopped one never answers, and the time to heal counts from the timeout.
QUERY_SECONDS = 0.5

# Global rank -> (host, pid, start time) of every rank of WORLD (under ULFM), gathered
# at start-up; the start time tells the process from a later one given the same pid.
_peers: list[tuple[str, int, int]] = []


def _started(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot), or -1 if there is none."""
    fields = job.process_stat(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else -1


def learn_peers(world_comm) -> None:
    """At start-up (every rank of WORLD calls it): where each rank runs, so that a hung
    one can be ended from its node."""
    global _peers
    if faults.ulfm():
        me = (socket.gethostname(), os.getpid(), _started(os.getpid()))
        _peers = [tuple(p) for p in world_comm.allgather(me)]
    else:
        _peers = []


def renumber(old_ranks: list[int]) -> None:
    """The world was shrunk to the processes of ``old_ranks`` (their ranks before, in
    their new order): where they run is known without asking them again, so that a
    member that hangs while the shrunk world starts can be found."""
    global _peers
    if _peers:
        _peers = [_peers[g] for g in old_ranks]


def stopped_here(rank: int) -> bool:
    """Whether ``rank``'s process runs on this node and is stopped (SIGSTOP or traced):
    a hang found without asking it, where no control channel runs yet."""
    if rank >= len(_peers) or _peers[rank][0] != socket.gethostname():
        return False
    _, pid, started = _peers[rank]
    fields = job.process_stat(pid)
    return (fields is not None and len(fields) > 19 and int(fields[19]) == started
            and fields[0] in ("T", "t"))


def pids_on_this_node() -> list[int]:
    """The pids of the world's processes on this node (what start-up learnt; under ULFM)."""
    host = socket.gethostname()
    return [pid for h, pid, _ in _peers if h == host]


def _kill_here(rank: int) -> bool | None:
    """SIGKILL ``rank``'s process if it runs on this node: True if it was alive (the
    same process start-up saw, not a later one with its pid), False if it was gone, None
    if it runs elsewhere."""
    if rank >= len(_peers) or _peers[rank][0] != socket.gethostname():
        return None
    _, pid, started = _peers[rank]
    if _started(pid) != started:
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
        return True
    return False


def end_excluded(ranks: tuple[int, ...]) -> list[int]:
    """The survivors agreed that ``ranks`` died; one whose process still runs (MPI's
    detector said so wrongly, or it hung) is ended now rather than go on alone with a
    world that excluded it: killed on this node, told elsewhere.  The ranks found alive
    here."""
    alive, elsewhere = [], []
    for r in ranks:
        found = _kill_here(r)
        if found:
            alive.append(r)
        elif found is None:
            elsewhere.append(r)
    if elsewhere and state.channel is not None:
        state.channel.notify(elsewhere, {"q": "excluded", "from": state.rank,
                                         "reason": "the survivors agreed it died"})
    return alive


def culprits(peers: list[int], replies: dict[int, dict], seq: int) -> list[int]:
    """The members holding collective ``seq`` up: silent, or behind it and in no spmd op."""
    out = []
    for r in peers:
        rep = replies.get(r)
        if rep is None or "error" in rep:
            out.append(r)
        elif (rep.get("no_group") or rep.get("seq", 0) < seq) and not rep.get("busy"):
            out.append(r)
    return out


def end(g: GroupContext, ranks: list[int], replies: dict[int, dict], reason: str) -> str:
    """End the hung members ``ranks`` (global) of ``g``; the words of what was done."""
    me = g.ranks[g.rank]
    host = socket.gethostname()
    ch = state.channel
    told, killed, left = [], [], []
    answered = [r for r in ranks if r in replies and "error" not in replies[r]]
    if ch is not None and answered:
        ch.notify(answered, {"q": "excluded", "from": me, "reason": reason})
        told = answered
    for r in ranks:
        if _kill_here(r) is not None:
            killed.append(r)
        elif r not in told:
            left.append(r)
    parts = []
    if told:
        parts.append(f"told rank(s) {told} to end (they answered, and wait for nothing of "
                     "spmd's)")
    if killed:
        parts.append(f"killed rank(s) {killed} on this node ({host})")
    if left:
        parts.append(f"rank(s) {left} run on other nodes and did not answer: left to the "
                     "survivors there")
    return "; ".join(parts)


def await_failure(ranks: list[int], seconds: float = 2.0) -> bool:
    """Wait until MPI reports ``ranks`` (global) dead; False if it has not in time."""
    world = world_state.world
    if world is None:
        return False
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if set(ranks) <= set(faults.known_failed(world.context)):
            return True
        time.sleep(0.005)
    return False


def excluded(request: dict) -> None:
    """The survivors excluded this rank as hung (runs on the control thread): end the
    process, as a killed rank, so MPI reports it failed."""
    report(f"spmd: the survivors excluded this rank as hung ({request.get('reason', '')}, "
           f"said by rank {request.get('from')}); ending this process")
    os.kill(os.getpid(), signal.SIGKILL)
