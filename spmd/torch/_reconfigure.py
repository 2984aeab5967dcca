"""torch's reconfigure on the "spmd" backend: the default group rebuilt on given processes.

torch 2.14's contract: ``init_process_group(..., enable_reconfigure=True)`` makes a group
whose every process gives an opaque handle (``get_reconfigure_handle()``), published out
of band (a store); ``reconfigure(uuid, handles)``, called by every process whose handle
is given, rebuilds the group on exactly those processes, fewer (a shrink) or new ones (a
grow).  On "spmd" the group is usable at once (MPI made it); reconfigure rebuilds it.

A handle names one process of one world (the communicator it is in now) and how others
reach it; the handles alone say how the group is built (spmd.torch._handles): the
listed members of the largest world (or of the world that started new processes) keep
going, shrinking it if some are missing (``spmd.shrink_group``: under ULFM the
survivors' communicator); processes :func:`spawn_peers` started join through the link
their start made; any other world joins through its rank 0's MPI port
(``MPI_Comm_connect`` by the group so far, ``MPI_Comm_accept`` there): processes started
by the user or the scheduler (an MPI that connects separately started jobs: MPICH's
Hydra does; Open MPI's wheel does not, without a PMIx server the jobs share).

The rebuilt group is spmd's WORLD and torch's default group.  torch keeps a Python-made
group's rank and size in C++ (where DDP's reducer reads the size), and only a C++ backend
can change them there, so the default group is made anew, a new ProcessGroup object on
the same store, and every other group ends, as after torch's ``shrink_group``: read
``dist.group.WORLD`` again, and make DDP and subgroups anew.
"""

from __future__ import annotations

import dataclasses
import secrets
from datetime import timedelta
from typing import Any

import torch.distributed as dist

import spmd
from spmd.backends.mpi import replacement
from spmd.runtime import heal
from spmd.torch._handles import Handle, plan
from spmd.torch._store import (
    claim_world,
    owns_world,
    release_world,
    store_address,
    store_for,
)
from spmd.torch._work import SpmdWork

__all__ = ["enable", "handle", "reconfigure", "spawn_peers"]

_OP = "reconfigure"


@dataclasses.dataclass
class _World:
    """What this process's handle says: its world, the spmd group that is it, and what
    torch's default group is made anew with after a reconfigure."""

    id: str
    parent: str
    group: Any            # the spmd ProcessGroup (WORLD) the id names
    store: Any            # torch's default store
    timeout: timedelta | None
    port: str = ""


_current: list[_World] = []   # this process's world, once a group enabled reconfigure


def _default_store(backend_store: Any) -> Any:
    """torch's default store, from the store its creator got for the default group:
    torch puts two prefixes in front of it there (the group's name, the device)."""
    store = backend_store
    for _ in range(2):
        if not isinstance(store, dist.PrefixStore):
            return None
        store = store.underlying_store
    return store


def enable(pg: Any, backend_store: Any, timeout: timedelta | None) -> None:
    """Make the default group ``pg`` (an SpmdProcessGroup) one that reconfigures: its
    world gets its id; every process of it calls this, at the group's creation."""
    group = pg.spmd_group
    store = _default_store(backend_store)
    peer = replacement.joined_as_peer()
    if peer is not None and "parent" in peer.extra and not _current:
        # Started by spawn_peers: the world's id is the link's, which the starting world
        # gave out in these processes' handles already.
        _current[:] = [_World(peer.link, str(peer.extra["parent"]), group, store, timeout)]
        return
    token = [secrets.token_hex(8) if group.rank() == 0 else None]
    spmd.broadcast_object_list(token, group_src=0, group=group)
    _current[:] = [_World(str(token[0]), "", group, store, timeout)]


def _world_of(pg: Any, op: str) -> _World:
    default: Any = dist.group.WORLD
    if pg is not default:
        raise RuntimeError(f"{op}: only the default group reconfigures on the spmd backend "
                           "(torch's enable_reconfigure is init_process_group's)")
    if not _current or _current[0].group is not pg.spmd_group:
        why = "it was not made with init_process_group(..., enable_reconfigure=True)" \
            if not _current else "it changed since (dist.shrink_group? reconfigure " \
            "shrinks too: pass the survivors' handles)"
        raise RuntimeError(f"{op}: the default group has no reconfigure handle: {why}")
    return _current[0]


def handle(pg: Any) -> str:
    """This process's reconfigure handle in the default group ``pg`` (a local call)."""
    w = _world_of(pg, "get_reconfigure_handle")
    group = pg.spmd_group
    if group.rank() == 0 and not w.parent and not w.port:
        w.port = heal.open_port()   # for worlds started by others (module docstring, 4)
    return Handle(w.id, group.rank(), group.size(), w.parent, w.port).encode()


def spawn_peers(count: int) -> list[str]:
    """Start ``count`` processes running this program, to join the default group by a
    later reconfigure; their handles.

    Every process of the default group (made with ``enable_reconfigure=True``) calls
    it, after any shrink (a reconfigure of its own).  In each new process
    ``init_process_group("spmd", enable_reconfigure=True)`` makes a group of the new
    processes whose store is this group's (where it is the TCPStore of the spmd
    backend's rendezvous), and ``spmd.is_replacement()`` is True; a reconfigure with
    every handle of this group and theirs then joins them.

    Returns:
        The new processes' handles, in their order (every process gets the same list).

    Raises:
        RuntimeError: the default group does not reconfigure, or MPI could not start
            the processes (Open MPI: under ULFM, ``mpiexec --with-ft ulfm``).
    """
    pg: Any = dist.group.WORLD
    if pg is None or pg.getBackendName() != "spmd":
        raise RuntimeError("spawn_peers: the default group is not the spmd backend's; call "
                           "init_process_group(\"spmd\", enable_reconfigure=True) first")
    w = _world_of(pg, "spawn_peers")
    link = heal.spawn_peers(count, {"parent": w.id, "store": store_address()})
    return [Handle(link, r, count, w.id).encode() for r in range(count)]


def reconfigure(pg: Any, opts: Any) -> SpmdWork:
    """torch's ``ProcessGroup.reconfigure`` for the default group ``pg``: rebuild it on
    the processes ``opts.handles`` names (see the module docstring); every one of them
    calls it with the same ``uuid`` and handles.  Done when it returns: the Work it
    gives is complete, and torch's default group is a new object.

    Raises:
        ValueError: handles that cannot make one group (before anything is sent).
        RuntimeError: this process's handle is not among them, or MPI refused a step.
    """
    w = _world_of(pg, _OP)
    raw = opts.handles
    ordered = not isinstance(raw, (set, frozenset))
    texts = list(raw) if ordered else sorted(raw)
    handles = [Handle.decode(t, f"handles[{i}]") for i, t in enumerate(texts)]
    group = pg.spmd_group
    me = Handle(w.id, group.rank(), group.size(), w.parent, w.port)
    mine = [h for h in handles if (h.world, h.rank) == (me.world, me.rank)]
    if not mine:
        raise RuntimeError(f"{_OP}: this process's handle is not among the {len(handles)} "
                           f"given (it is {me.encode()!r:.80}); only the processes named "
                           "call reconfigure, with handles from get_reconfigure_handle() "
                           "since the last reconfigure")
    if w.store is None:
        raise RuntimeError(f"{_OP}: torch's default store of this group is unknown (a torch "
                           "release whose stores the spmd backend does not know)")
    p = plan(handles, ordered)
    if me.world == p.base and len(p.base_kept) < p.base_size:
        dropped = sorted(set(range(p.base_size)) - set(p.base_kept))
        group = spmd.shrink_group(dropped, group)   # renumbers: the kept ranks, in order
    steps = p.steps(me)
    ranks = [h.rank for h in p.order]
    if steps or ranks != sorted(ranks):   # else the (shrunk) base is the group, in order
        group = heal.regroup_world(steps, p.order.index(mine[0]))
    if w.port and w.port not in {port for _, port in p.by_port}:
        heal.close_port(w.port)   # the port of a world that ended, never used
    _remake_default_group(group, w)
    return SpmdWork([], [], _OP, group)


def _remake_default_group(group: Any, w: _World) -> None:
    """torch's default group made anew over ``group``, spmd's new WORLD (every process of
    it calls this).  torch keeps a Python-made group's rank and size in C++, where only
    a C++ backend can change them, and DDP's reducer reads the size there: so the old
    group goes, with every other (their ranks meant the old numbering), as after torch's
    ``shrink_group``, and ``init_process_group`` makes the new one on the same store (a
    new one where the process serving it was lost)."""
    owned = owns_world()
    release_world()   # destroying torch's group must leave spmd's new world alone
    dist.destroy_process_group()
    if owned:
        claim_world()
    again: dict[str, Any] = {"enable_reconfigure": True}   # torch 2.14's (typing sees 2.13)
    dist.init_process_group("spmd", store=store_for(w.store, w.timeout), rank=group.rank(),
                            world_size=group.size(), timeout=w.timeout, **again)
