"""A process started by the survivors of a failure to take a lost rank's place.

:func:`spmd.heal` (``spmd.runtime.heal``) starts new processes running the same program
with ``MPI_Comm_spawn`` from the survivors' world and merges with them.  This module is
both ends of what follows the spawn, so the two cannot drift apart:

1. the merged communicator: the survivors first, in their order, then the new processes;
2. the survivors' rank 0 sends the plan (:class:`HealPlan`): the world's full size and the
   ranks the lost processes held, which the new ones take in order;
3. every process splits the merged communicator by its rank in the full world, so the
   world has its old numbering again and layouts rebuilt on it are the ones from before.

A new process reaches step 1 from ``init_process_group()``: its MPI parent is the
survivors' world (:func:`parent`).

Processes started to join *later* (torch's ``reconfigure``, spmd.torch) get a peer plan
instead (:func:`send_peer_plan`): they open a world of their own (the spawned processes'
``COMM_WORLD``) and both sides keep the merged communicator, the *link*, under one id
(:data:`links`), until a regrouping (``spmd.runtime.heal.regroup_world``) takes it.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
import threading
from typing import Any, cast

from mpi4py import MPI

from spmd.backends.mpi import recoverable_spawn

__all__ = ["HealPlan", "PeerPlan", "join", "joined_as_peer", "links", "parent", "regroup",
           "send_peer_plan", "send_plan", "started_recoverable"]

_MAGIC = "spmd-heal-1"   # what the plan says first: a parent that is not spmd's healing is refused
_PEER_MAGIC = "spmd-peer-1"   # a peer plan's: the new processes join later

# Link id -> the merged communicator of the processes that started peers and those
# peers (both sides keep it, each under the same id), until a regrouping takes it.
links: dict[str, MPI.Intracomm] = {}


@dataclasses.dataclass(frozen=True)
class HealPlan:
    """What the survivors tell the processes they started."""

    full_size: int               # the world's size before the failures
    lost: tuple[int, ...]        # the ranks the new processes take, in their merged order
    name: str                    # the world's name


@dataclasses.dataclass(frozen=True)
class PeerPlan:
    """What the processes that started peers tell them: the link's id and what the
    starting layer passes on (spmd.torch: the parents' world and store)."""

    link: str
    extra: dict[str, Any]


_joined: list[PeerPlan] = []   # this process's peer plan, if it was started as a peer


def joined_as_peer() -> PeerPlan | None:
    """The peer plan this process was started with (:func:`send_peer_plan`), or None."""
    return _joined[0] if _joined else None


# A process started as a recoverable job whose starters gave up waiting for it (they
# started others in its place: spmd.runtime.heal's JOIN_SECONDS, three times) ends after
# this long instead of waiting to connect forever, which would hold the launcher.
ABANDONED_SECONDS = 45.0

_started_recoverable: list[bool] = []   # set by parent(): this process joined by a port


def started_recoverable() -> bool:
    """Whether this process was started as a recoverable job (it may leave without
    ``MPI_Finalize``, and its death does not fail the launcher)."""
    return bool(_started_recoverable)


_leave_timer: list[threading.Timer] = []   # ends a process never joined (parent to join)


def _leave(why: str) -> None:
    """A process started to join a group that is gone or gave it up: it was never part
    of any world, so it leaves at once, with status 0 (its job is recoverable)."""
    sys.stderr.write(f"spmd: a process started by heal() leaves without joining: {why}\n")
    sys.stderr.flush()
    os._exit(0)   # no exit handler: MPI may be blocked on another thread


def parent() -> MPI.Intercomm | None:
    """The survivors' world if this process was started to replace a lost rank (or to
    join later), else None: the port they opened, for a process started as a
    recoverable job (:mod:`spmd.backends.mpi.recoverable_spawn`; it leaves if they are
    gone); MPI's parent for one ``MPI_Comm_spawn`` started."""
    port = recoverable_spawn.take_port()
    if port is not None:
        leave = threading.Timer(ABANDONED_SECONDS, _leave, (f"not joined within "
                                                            f"{ABANDONED_SECONDS:g} s",))
        leave.daemon = True
        leave.start()
        _leave_timer[:] = [leave]
        try:
            world = MPI.COMM_WORLD.Dup()
            world.Set_errhandler(MPI.ERRORS_RETURN)
            inter = world.Connect(port, root=0)
            world.Free()
        except MPI.Exception as exc:
            _leave(f"the processes that started it are gone ({exc.Get_error_string()})")
        _started_recoverable[:] = [True]
        return inter
    p = MPI.Comm.Get_parent()
    return None if p == MPI.COMM_NULL else p


def regroup(merged: MPI.Intracomm, rank: int) -> MPI.Intracomm:
    """The world in its old numbering: ``merged`` split by each process's ``rank`` there."""
    world = cast(MPI.Intracomm, merged.Split(0, rank))
    world.Set_errhandler(MPI.ERRORS_RETURN)
    return world


def join(inter: MPI.Intercomm) -> tuple[MPI.Intracomm, HealPlan]:
    """A new process's end of the healing: merge with the survivors, learn the plan and
    its rank, and return the world in its old numbering (a communicator of its own).
    A process started as a recoverable job whose starters fail on the way leaves."""
    try:
        out = _join(inter)
    except MPI.Exception as exc:
        if not _started_recoverable:
            raise
        _leave(f"the processes that started it failed while it joined "
               f"({exc.Get_error_string()})")
    for timer in _leave_timer:
        timer.cancel()
    return out


def _join(inter: MPI.Intercomm) -> tuple[MPI.Intracomm, HealPlan]:
    # Errors come back as exceptions, as on every communicator of spmd's: the parent's
    # communicator starts with MPI's default handler, which aborts the job.
    inter.Set_errhandler(MPI.ERRORS_RETURN)
    merged = inter.Merge(high=True)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    plan = merged.bcast(None, root=0)
    if isinstance(plan, dict) and plan.get("magic") == _PEER_MAGIC:
        # A peer: a world of the processes started together; the link waits for later.
        links[plan["link"]] = merged
        _joined[:] = [PeerPlan(plan["link"], dict(plan["extra"]))]
        world = MPI.COMM_WORLD.Dup()
        world.Set_errhandler(MPI.ERRORS_RETURN)
        return world, HealPlan(world.Get_size(), (), plan["name"])
    if not isinstance(plan, dict) or plan.get("magic") != _MAGIC:
        raise RuntimeError("init_process_group: this process was started by MPI_Comm_spawn, "
                           "but not by spmd.heal() (its parent sent no healing plan); a "
                           "program spawned by other means cannot be an spmd replacement")
    p = HealPlan(plan["full_size"], tuple(plan["lost"]), plan["name"])
    mine = p.lost[merged.Get_rank() - (merged.Get_size() - len(p.lost))]
    world = regroup(merged, mine)
    merged.Free()
    return world, p


def send_plan(merged: MPI.Intracomm, plan: HealPlan) -> None:
    """The survivors' end of step 2 (every survivor calls it; rank 0's plan goes out)."""
    merged.bcast({"magic": _MAGIC, **dataclasses.asdict(plan)}, root=0)


def send_peer_plan(merged: MPI.Intracomm, name: str, extra: dict[str, Any]) -> str:
    """The starting processes' end of a peer plan (every one of them calls it, after the
    merge): the link's id, the same on both sides; ``merged`` is kept under it."""
    link = secrets.token_hex(8) if merged.Get_rank() == 0 else None
    plan = merged.bcast({"magic": _PEER_MAGIC, "link": link, "name": name, "extra": extra},
                        root=0)
    links[plan["link"]] = merged
    return plan["link"]
