"""The rendezvous of an spmd job: a torch TCPStore whose address travels over MPI.

torch wants a key-value store for every process group; under ``mpiexec``/``srun``
nobody set ``MASTER_ADDR`` or ``RANK``, and need not: MPI already knows the ranks.
Rank 0 starts a TCPStore on a free port and broadcasts its address over spmd's WORLD.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import spmd
from spmd.backends.mpi import replacement

__all__ = ["mpi_rendezvous", "owns_world", "store_address", "store_for"]

_owned = {"world": False}
_address: list[tuple[str, int]] = []   # the rendezvous store's (host, port), once made
_serving: list[bool] = []              # whether this process runs that store's server


def owns_world() -> bool:
    """True when the backend (not the user) initialised spmd, so it tears it down too."""
    return _owned["world"]


def ensure_spmd(timeout: timedelta | None, pg_options=None) -> None:
    """Initialise spmd's WORLD if nobody has (the backend then owns it)."""
    if not spmd.is_initialized():
        spmd.init_process_group(timeout=timeout, pg_options=pg_options)
        _owned["world"] = True


def store_address() -> tuple[str, int] | None:
    """The (host, port) of the TCPStore the last MPI rendezvous made (rank 0's), or None
    (the program gave torch a store of its own)."""
    return _address[0] if _address else None


def release_world() -> None:
    """Forget that the backend owns WORLD (after it destroyed it)."""
    _owned["world"] = False


def claim_world() -> None:
    """The backend owns WORLD again (torch's default group, made anew over a world that
    a reconfigure made, takes it over)."""
    _owned["world"] = True


def _host(hosts: list[str]) -> str:
    if len(set(hosts)) == 1:
        return "127.0.0.1"
    try:
        return socket.gethostbyname(hosts[0])
    except OSError:
        return hosts[0]


def mpi_rendezvous(rank: int, world_size: int, timeout: timedelta | None):
    """(store, rank, world_size) for ``init_process_group``, agreed over MPI.

    Every rank of the MPI job calls it.

    Raises:
        ValueError: ``rank`` or ``world_size`` was given and disagrees with MPI.
    """
    import torch.distributed as dist

    ensure_spmd(timeout)
    me, n = spmd.get_rank(), spmd.get_world_size()
    if world_size not in (-1, None) and world_size != n:
        raise ValueError(f"init_process_group: world_size={world_size} but the MPI job has "
                         f"{n} ranks [rank {me}]")
    if rank not in (-1, None) and rank != me:
        raise ValueError(f"init_process_group: rank={rank} but MPI says this is rank {me} "
                         f"(of {n})")
    seconds = timeout if timeout is not None else timedelta(minutes=30)
    peer = replacement.joined_as_peer()
    if peer is not None and peer.extra.get("store"):
        # Started to join a group later (spmd.torch.spawn_peers): that group's store, where
        # its processes publish what this one needs (their handles).
        host, port = peer.extra["store"]
        _address[:] = [(host, port)]
        return dist.TCPStore(host, port, n, False, seconds), me, n
    return _serve(me, n, seconds), me, n


def _serve(me: int, n: int, seconds: timedelta):
    """A TCPStore on WORLD's rank 0 (its server) and every rank's client of it, its
    address agreed over MPI (every rank of WORLD calls it)."""
    import torch.distributed as dist

    hosts: list[Any] = [None] * n  # every rank's host name, once gathered
    spmd.all_gather_object(hosts, socket.gethostname())
    address: list[Any] = [None]  # rank 0's (host, port)
    store: dist.TCPStore | None = None
    if me == 0:
        host = _host(hosts)
        store = dist.TCPStore(host, 0, n, True, seconds, wait_for_workers=False)
        address[0] = (host, store.port)
    spmd.broadcast_object_list(address, src=0)
    _address[:] = [tuple(address[0])]
    _serving[:] = [me == 0]
    if me != 0:
        host, port = address[0]
        store = dist.TCPStore(host, port, n, False, seconds)
    return store


def store_for(world_store: Any, timeout: timedelta | None):
    """The store of torch's default group made anew over spmd's WORLD after it changed
    (every rank of WORLD calls it): the same one while the process serving it is in
    WORLD; a new one, served by WORLD's rank 0, once that process was lost (a store whose
    server died answers nothing, and everything after a reconfigure needs one)."""
    import numpy as np

    served = np.array([int(bool(_serving) and _serving[0])], np.int32)
    spmd.all_reduce(served, op=spmd.ReduceOp.MAX)
    if served[0]:
        return world_store
    import torch.distributed as dist

    seconds = timeout if timeout is not None else timedelta(minutes=30)
    # The prefix torch puts in front of a rendezvous' store: what the processes that join
    # later (spmd.torch.spawn_peers) see through theirs.
    return dist.PrefixStore("default_pg", _serve(spmd.get_rank(), spmd.get_world_size(),
                                                 seconds))
