"""Collectives of picklable Python objects.

Objects are pickled into one byte buffer per rank; sizes travel first, then the bytes
in nonblocking MPI calls, so every wait honours the group's timeout.  Buffers too
large for one MPI call (counts and displacements past 2**31-1 bytes, which MPI-3
libraries such as Open MPI 4 refuse and some MPI-4 ones mishandle) travel in rounds
of at most 1 GiB per rank, so objects of any size work on every MPI library.

In debug mode (``SPMD_DEBUG=DETAIL``) the collectives compare their fingerprint (op,
root, list length for broadcast_object_list) across the group before anything is sent;
send/recv_object_list are point to point and pass unchecked, like send/recv.

Trust: receiving ranks unpickle what peers send, and unpickling can run arbitrary
code.  Every rank of an MPI job is trusted; never use object collectives to talk to
a program you do not trust.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from spmd.api.collectives import root_rank
from spmd.api.p2p import peer_rank
from spmd.backends import checked as _checked
from spmd.backends.mpi.engine import OBJECT_TAG
from spmd.backends.mpi.work import MPIWork
from spmd.core.errors import DistTimeoutError, located
from spmd.runtime.group import GroupArg, ProcessGroup, resolve

__all__ = [
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
]

_I64 = np.dtype(np.int64)
_U8 = np.dtype(np.uint8)


def _dumps(obj) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), _U8)


def _loads(buf: np.ndarray):
    return pickle.loads(buf.data)


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


def _wait(pg: ProcessGroup, op: str, reqs, keep=None, status=None) -> MPIWork:
    work = MPIWork(reqs if isinstance(reqs, list) else [reqs], op, pg.context, None, keep=keep, status=status)
    work.wait()
    return work


def _gather_bytes(pg: ProcessGroup, op: str, data: np.ndarray, sizes: list[int], root: int | None):
    """Every rank's ``data`` concatenated in rank order: on every rank (root None,
    all-gather) or on ``root`` (gather; None elsewhere).  ``sizes`` are all ranks' sizes."""
    nrounds, per = _rounds(sizes)
    gets = root is None or pg.context.rank == root
    _, offsets = _displs(sizes)
    out = np.empty(sum(sizes), _U8) if gets else None
    for k in range(nrounds):
        counts = [min(per, max(0, s - k * per)) for s in sizes]
        counts, displs = _displs(counts)
        piece = data[k * per:k * per + counts[pg.context.rank]]
        tmp = out if nrounds == 1 else (np.empty(sum(counts), _U8) if gets else None)
        rspec = [tmp, (counts, displs)] if gets else None
        if root is None:
            req = pg.context.comm.Iallgatherv(piece, rspec)
        else:
            req = pg.context.comm.Igatherv(piece, rspec, root)
        _wait(pg, op, req, (piece, tmp))
        if gets and nrounds > 1:
            assert out is not None and tmp is not None  # both are made where gets
            for r, (c, d) in enumerate(zip(counts, displs)):
                out[offsets[r] + k * per:offsets[r] + k * per + c] = tmp[d:d + c]
    if out is None:  # not gets
        return None
    return [out[o:o + s] for o, s in zip(offsets, sizes)]


def _all_sizes(pg: ProcessGroup, op: str, data: np.ndarray) -> list[int]:
    sizes = np.empty(pg.context.size, _I64)
    _wait(pg, op, pg.context.comm.Iallgather(np.array([data.size], _I64), sizes), sizes)
    return [int(x) for x in sizes]


def _displs(sizes) -> tuple[list[int], list[int]]:
    counts = [int(s) for s in sizes]
    displs, total = [], 0
    for c in counts:
        displs.append(total)
        total += c
    return counts, displs


def _check_list(obj_list, op: str, arg: str, pg: ProcessGroup, length: int | None = None) -> list:
    if not isinstance(obj_list, list):
        raise located(TypeError, op, f"{arg} must be a list, got {type(obj_list).__name__}", pg.context)
    if length is not None and len(obj_list) != length:
        raise located(ValueError, op, f"{arg} has {len(obj_list)} entries, expected {length} "
                      "(the group size)", pg.context)
    return obj_list


def all_gather_object(object_list: list[Any], obj: object, group: GroupArg = None) -> None:
    """Gather every rank's ``obj`` into ``object_list`` (one entry per rank) on every rank."""
    op = "all_gather_object"
    pg = resolve(group, op)
    if pg is None:
        return None
    _check_list(object_list, op, "object_list", pg, pg.context.size)
    if _checked.active:
        _checked.check_op(pg.context, op)
    data = _dumps(obj)
    for i, buf in enumerate(_gather_bytes(pg, op, data, _all_sizes(pg, op, data), None)):
        object_list[i] = _loads(buf)
    return None


def gather_object(obj: object, object_gather_list: list[Any] | None = None,
                  dst: int | None = None, group: GroupArg = None,
                  group_dst: int | None = None) -> None:
    """Gather every rank's ``obj`` into ``object_gather_list`` on rank ``dst``."""
    op = "gather_object"
    pg = resolve(group, op)
    if pg is None:
        return None
    root = root_rank(pg, op, dst, group_dst, "dst", default=0)
    is_root = pg.context.rank == root
    if is_root:
        _check_list(object_gather_list, op, "object_gather_list", pg, pg.context.size)
    if _checked.active:
        _checked.check_op(pg.context, op, root)
    data = _dumps(obj)
    # every rank learns every size: all of them need the number of rounds
    bufs = _gather_bytes(pg, op, data, _all_sizes(pg, op, data), root)
    if is_root:
        assert object_gather_list is not None  # _check_list raised otherwise
        for i, buf in enumerate(bufs):
            object_gather_list[i] = _loads(buf)
    return None


def broadcast_object_list(object_list: list[Any], src: int | None = None, group: GroupArg = None,
                          device: object = None, group_src: int | None = None) -> None:
    """Replace the entries of ``object_list`` on every rank with those of rank ``src``.

    The list must have the same length on every rank.
    """
    op = "broadcast_object_list"
    pg = resolve(group, op)
    if pg is None:
        return None
    root = root_rank(pg, op, src, group_src, "src", default=0)
    _check_list(object_list, op, "object_list", pg)
    if _checked.active:
        _checked.check_op(pg.context, op, object_list, root)
    is_root = pg.context.rank == root
    data = _dumps(object_list) if is_root else None
    size = np.array([data.size if data is not None else 0], _I64)
    _wait(pg, op, pg.context.comm.Ibcast(size, root), size)
    if data is None:  # not the root
        data = np.empty(int(size[0]), _U8)
    _wait(pg, op, [pg.context.comm.Ibcast(p, root) for p in _pieces(data)], data)
    if is_root:
        return None
    received = _loads(data)
    if len(received) != len(object_list):
        raise located(ValueError, op, f"object_list has {len(object_list)} entries but the "
                      f"source sent {len(received)}; the list must have the same length on "
                      "every rank", pg.context)
    object_list[:] = received
    return None


def scatter_object_list(scatter_object_output_list: list[Any],
                        scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: GroupArg = None,
                        group_src: int | None = None) -> None:
    """Send ``scatter_object_input_list[i]`` from rank ``src`` to group rank i, which stores
    it in ``scatter_object_output_list[0]``."""
    op = "scatter_object_list"
    pg = resolve(group, op)
    if pg is None:
        return None
    root = root_rank(pg, op, src, group_src, "src", default=0)
    out = _check_list(scatter_object_output_list, op, "scatter_object_output_list", pg)
    if not out:
        raise located(ValueError, op, "scatter_object_output_list must have at least one entry", pg.context)
    is_root = pg.context.rank == root
    if is_root:
        _check_list(scatter_object_input_list, op, "scatter_object_input_list", pg, pg.context.size)
    if _checked.active:
        _checked.check_op(pg.context, op, root)
    if is_root:
        assert scatter_object_input_list is not None  # _check_list raised otherwise
        pieces = [_dumps(o) for o in scatter_object_input_list]
        sizes = np.array([p.size for p in pieces], _I64)
        sbuf = np.concatenate(pieces)
    else:
        sizes = np.empty(pg.context.size, _I64)
        sbuf = None
    # every rank learns every size: all of them need the number of rounds
    _wait(pg, op, pg.context.comm.Ibcast(sizes, root), sizes)
    nbytes = [int(x) for x in sizes]
    nrounds, per = _rounds(nbytes)
    _, offsets = _displs(nbytes)
    rbuf = np.empty(nbytes[pg.context.rank], _U8)
    for k in range(nrounds):
        counts, displs = _displs([min(per, max(0, s - k * per)) for s in nbytes])
        sspec = None
        if sbuf is not None:  # the root
            send = sbuf if nrounds == 1 else np.concatenate(
                [sbuf[o + k * per:o + k * per + c] for o, c in zip(offsets, counts)])
            sspec = [send, (counts, displs)]
        mine = rbuf[k * per:k * per + counts[pg.context.rank]]
        _wait(pg, op, pg.context.comm.Iscatterv(sspec, mine, root), (sspec, mine))
    out[0] = _loads(rbuf)
    return None


def send_object_list(object_list: list[Any], dst: int | None = None, group: GroupArg = None,
                     device: object = None, group_dst: int | None = None,
                     use_batch: bool = False) -> None:
    """Send the objects of ``object_list`` to rank ``dst`` in one message.

    ``device`` and ``use_batch`` are accepted for torch compatibility; objects always
    travel through host memory in one message.
    """
    op = "send_object_list"
    pg = resolve(group, op)
    if pg is None:
        return None
    peer = peer_rank(pg, op, dst, group_dst, "dst")
    _check_list(object_list, op, "object_list", pg)
    data = _dumps(object_list)
    # a header with the size, then the bytes in pieces one message can carry; MPI keeps
    # messages between two ranks on one tag in order
    header = np.array([data.size], _I64)
    pieces = _pieces(data)
    reqs = [pg.context.comm.Isend(header, peer, OBJECT_TAG)]
    reqs += [pg.context.comm.Isend(p, peer, OBJECT_TAG) for p in pieces]
    _wait(pg, op, reqs, (header, data))
    return None


def recv_object_list(object_list: list[Any], src: int | None = None, group: GroupArg = None,
                     device: object = None, group_src: int | None = None,
                     use_batch: bool = False) -> int:
    """Receive objects sent by :func:`send_object_list` into ``object_list`` (same length).

    Returns:
        The global rank of the sender (``src=None`` receives from any rank).
    """
    op = "recv_object_list"
    pg = resolve(group, op)
    if pg is None:
        return -1
    peer = peer_rank(pg, op, src, group_src, "src", any_source=True)
    _check_list(object_list, op, "object_list", pg)
    status = MPI.Status()
    source = MPI.ANY_SOURCE if peer is None else peer
    # A matched probe pairs the size with its own message, even with other threads.
    start = time.monotonic()
    while True:
        msg = pg.context.comm.Improbe(source, OBJECT_TAG, status)
        if msg is not None:
            break
        if time.monotonic() - start > pg.context.timeout:
            raise DistTimeoutError(f"{op}: no message arrived within {pg.context.timeout:.1f} s "
                                   f"[rank {pg.context.rank}, group {pg.context.name}]")
    header = np.empty(1, _I64)
    _wait(pg, op, msg.Irecv(header), header)
    sender = status.Get_source()
    data = np.empty(int(header[0]), _U8)
    _wait(pg, op, [pg.context.comm.Irecv(p, sender, OBJECT_TAG) for p in _pieces(data)], data)
    received = _loads(data)
    if len(received) != len(object_list):
        raise located(ValueError, op, f"object_list has {len(object_list)} entries but the "
                      f"sender sent {len(received)}", pg.context)
    object_list[:] = received
    return pg.context.global_rank(sender)
