"""Collectives of picklable Python objects.

Objects are pickled into one byte buffer per rank, which the MPI engine's transport
(:mod:`spmd.backends.mpi.objects`) moves: sizes first, then the bytes in nonblocking
calls under the group's timeout, in rounds where a buffer is too large for one MPI call.

In debug mode (``SPMD_DEBUG=DETAIL``) the collectives compare their fingerprint (op,
root, list length for broadcast_object_list) across the group before anything is sent;
send/recv_object_list are point to point and pass unchecked, like send/recv.

Trust: receiving ranks unpickle what peers send, and unpickling can run arbitrary
code.  Every rank of an MPI job is trusted; never use object collectives to talk to
a program you do not trust.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from spmd.api.collectives import root_rank
from spmd.api.p2p import peer_rank
from spmd.backends import checked as _checked
from spmd.backends.mpi import objects as transport
from spmd.core.errors import located
from spmd.runtime.group import GroupArg, ProcessGroup, resolve

__all__ = [
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
]

_U8 = np.dtype(np.uint8)


def _dumps(obj) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), _U8)


def _loads(buf: np.ndarray):
    return pickle.loads(buf.data)


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
    ctx = pg.context
    bufs = transport.gather_bytes(ctx, op, data, transport.all_sizes(ctx, op, data), None)
    assert bufs is not None  # every rank gets them from an all-gather
    for i, buf in enumerate(bufs):
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
    ctx = pg.context
    bufs = transport.gather_bytes(ctx, op, data, transport.all_sizes(ctx, op, data), root)
    if is_root:
        assert object_gather_list is not None and bufs is not None  # checked, the root
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
    data = transport.broadcast_bytes(pg.context, op, _dumps(object_list) if is_root else None,
                                     root)
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
    pieces = None
    if is_root:
        assert scatter_object_input_list is not None  # _check_list raised otherwise
        pieces = [_dumps(o) for o in scatter_object_input_list]
    rbuf = transport.scatter_bytes(pg.context, op, pieces, root)
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
    transport.send_bytes(pg.context, op, _dumps(object_list), peer)
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
    data, sender = transport.recv_bytes(pg.context, op, peer)
    received = _loads(data)
    if len(received) != len(object_list):
        raise located(ValueError, op, f"object_list has {len(object_list)} entries but the "
                      f"sender sent {len(received)}", pg.context)
    object_list[:] = received
    return pg.context.global_rank(sender)
