"""The MPI engine's transport of the object collectives' bytes (spmd.api.objects pickles
and checks; this moves the bytes).

Sizes travel first, then the bytes in nonblocking MPI calls, so every wait honours the
group's timeout.  Buffers too large for one MPI call (counts and displacements past
2**31-1 bytes, which MPI-3 libraries such as Open MPI 4 refuse and some MPI-4 ones
mishandle) travel in rounds of at most 1 GiB per rank, so objects of any size work on
every MPI library.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from spmd.backends.mpi.engine import OBJECT_TAG
from spmd.backends.mpi.work import MPIWork
from spmd.core.context import GroupContext
from spmd.core.errors import DistTimeoutError

__all__ = ["all_sizes", "gather_bytes", "broadcast_bytes", "scatter_bytes", "send_bytes",
           "recv_bytes"]

_I64 = np.dtype(np.int64)
_U8 = np.dtype(np.uint8)

# One MPI call carries at most _LIMIT bytes in all (counts and displacements are C ints
# in MPI-3) and at most _CHUNK bytes per rank; larger transfers go in rounds.
_LIMIT = 2**31 - 1
_CHUNK = 1 << 30


def _rounds(sizes: list[int]) -> tuple[int, int]:
    """(number of rounds, bytes per rank per round) for buffers of ``sizes`` bytes."""
    if sum(sizes) <= _LIMIT and max(sizes) <= _CHUNK:
        return 1, max(max(sizes), 1)
    per = max(1, min(_CHUNK, _LIMIT // len(sizes)))
    return max(1, -(-max(sizes) // per)), per


def _pieces(buf: np.ndarray) -> list[np.ndarray]:
    """A buffer cut into pieces one MPI call can carry."""
    per = min(_CHUNK, _LIMIT)
    return [buf[i:i + per] for i in range(0, buf.size, per)] or [buf]


def _wait(group: GroupContext, op: str, reqs, keep=None, status=None) -> MPIWork:
    work = MPIWork(reqs if isinstance(reqs, list) else [reqs], op, group, None, keep=keep,
                   status=status)
    work.wait()
    return work


def gather_bytes(group: GroupContext, op: str, data: np.ndarray, sizes: list[int],
                 root: int | None) -> list[np.ndarray] | None:
    """Every rank's ``data`` concatenated in rank order: on every rank (root None,
    all-gather) or on ``root`` (gather; None elsewhere).  ``sizes`` are all ranks' sizes."""
    nrounds, per = _rounds(sizes)
    gets = root is None or group.rank == root
    _, offsets = _displs(sizes)
    out = np.empty(sum(sizes), _U8) if gets else None
    for k in range(nrounds):
        counts = [min(per, max(0, s - k * per)) for s in sizes]
        counts, displs = _displs(counts)
        piece = data[k * per:k * per + counts[group.rank]]
        tmp = out if nrounds == 1 else (np.empty(sum(counts), _U8) if gets else None)
        rspec = [tmp, (counts, displs)] if gets else None
        if root is None:
            req = group.comm.Iallgatherv(piece, rspec)
        else:
            req = group.comm.Igatherv(piece, rspec, root)
        _wait(group, op, req, (piece, tmp))
        if gets and nrounds > 1:
            assert out is not None and tmp is not None  # both are made where gets
            for r, (c, d) in enumerate(zip(counts, displs)):
                out[offsets[r] + k * per:offsets[r] + k * per + c] = tmp[d:d + c]
    if out is None:  # not gets
        return None
    return [out[o:o + s] for o, s in zip(offsets, sizes)]


def all_sizes(group: GroupContext, op: str, data: np.ndarray) -> list[int]:
    """Every rank's ``data.size``, on every rank."""
    sizes = np.empty(group.size, _I64)
    _wait(group, op, group.comm.Iallgather(np.array([data.size], _I64), sizes), sizes)
    return [int(x) for x in sizes]


def _displs(sizes) -> tuple[list[int], list[int]]:
    counts = [int(s) for s in sizes]
    displs, total = [], 0
    for c in counts:
        displs.append(total)
        total += c
    return counts, displs




def broadcast_bytes(group: GroupContext, op: str, data: np.ndarray | None,
                    root: int) -> np.ndarray:
    """The root's ``data`` (None elsewhere), on every rank: its size, then its bytes."""
    size = np.array([data.size if data is not None else 0], _I64)
    _wait(group, op, group.comm.Ibcast(size, root), size)
    if data is None:  # not the root
        data = np.empty(int(size[0]), _U8)
    _wait(group, op, [group.comm.Ibcast(p, root) for p in _pieces(data)], data)
    return data


def scatter_bytes(group: GroupContext, op: str, pieces: list[np.ndarray] | None,
                  root: int) -> np.ndarray:
    """Group rank i's piece of the root's ``pieces`` (None elsewhere), on rank i."""
    if pieces is not None:  # the root
        sizes = np.array([p.size for p in pieces], _I64)
        sbuf = np.concatenate(pieces)
    else:
        sizes = np.empty(group.size, _I64)
        sbuf = None
    # every rank learns every size: all of them need the number of rounds
    _wait(group, op, group.comm.Ibcast(sizes, root), sizes)
    nbytes = [int(x) for x in sizes]
    nrounds, per = _rounds(nbytes)
    _, offsets = _displs(nbytes)
    rbuf = np.empty(nbytes[group.rank], _U8)
    for k in range(nrounds):
        counts, displs = _displs([min(per, max(0, s - k * per)) for s in nbytes])
        sspec = None
        if sbuf is not None:  # the root
            send = sbuf if nrounds == 1 else np.concatenate(
                [sbuf[o + k * per:o + k * per + c] for o, c in zip(offsets, counts)])
            sspec = [send, (counts, displs)]
        mine = rbuf[k * per:k * per + counts[group.rank]]
        _wait(group, op, group.comm.Iscatterv(sspec, mine, root), (sspec, mine))
    return rbuf


def send_bytes(group: GroupContext, op: str, data: np.ndarray, peer: int) -> None:
    """``data`` to group rank ``peer``: a header with the size, then the bytes in pieces
    one message can carry (MPI keeps messages between two ranks on one tag in order)."""
    header = np.array([data.size], _I64)
    reqs = [group.comm.Isend(header, peer, OBJECT_TAG)]
    reqs += [group.comm.Isend(p, peer, OBJECT_TAG) for p in _pieces(data)]
    _wait(group, op, reqs, (header, data))


def recv_bytes(group: GroupContext, op: str, peer: int | None) -> tuple[np.ndarray, int]:
    """What :func:`send_bytes` sent from group rank ``peer`` (any rank if None), and the
    sender's group rank."""
    status = MPI.Status()
    source = MPI.ANY_SOURCE if peer is None else peer
    # A matched probe pairs the size with its own message, even with other threads.
    start = time.monotonic()
    while True:
        msg = group.comm.Improbe(source, OBJECT_TAG, status)
        if msg is not None:
            break
        if time.monotonic() - start > group.timeout:
            raise DistTimeoutError(f"{op}: no message arrived within {group.timeout:.1f} s "
                                   f"[rank {group.rank}, group {group.name}]")
    header = np.empty(1, _I64)
    _wait(group, op, msg.Irecv(header), header)
    sender = status.Get_source()
    data = np.empty(int(header[0]), _U8)
    _wait(group, op, [group.comm.Irecv(p, sender, OBJECT_TAG) for p in _pieces(data)], data)
    return data, sender
