"""Point-to-point operations: send/recv, their async forms, and batches of them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, overload

from spmd.api.collectives import group_rank_of
from spmd.backends.base import P2PItem
from spmd.backends.mpi.engine import check_tag
from spmd.backends.mpi.fastcall import direct
from spmd.core.arrays import array_in, array_out
from spmd.core.errors import located
from spmd.core.typing import Array
from spmd.core.work import Work
from spmd.runtime.group import GroupArg, ProcessGroup, resolve

__all__ = ["send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv"]

@overload
def peer_rank(pg: ProcessGroup, op: str, peer, group_peer, arg: str,
              any_source: Literal[False] = False) -> int: ...


@overload
def peer_rank(pg: ProcessGroup, op: str, peer, group_peer, arg: str, any_source: bool) -> int | None: ...


def peer_rank(pg: ProcessGroup, op: str, peer, group_peer, arg: str, any_source: bool = False) -> int | None:
    """Group rank of the peer given as a global rank or as ``group_<arg>``; None means
    any source (receives only)."""
    r = group_rank_of(pg, op, peer, group_peer, arg)
    if r is None:
        if any_source:
            return None
        raise located(ValueError, op, f"{arg} (a global rank) or group_{arg} (a group rank) "
                      "must be given", pg.context)
    if r == pg.context.rank:
        raise located(ValueError, op, f"{arg} is this rank itself; send and receive need "
                      "two different ranks", pg.context)
    return r


def isend(tensor: Array, dst: int | None = None, group: GroupArg = None, tag: int = 0,
          group_dst: int | None = None) -> Work | None:
    """Start sending ``tensor`` to rank ``dst``; return a Work."""
    pg = resolve(group, "isend")
    if pg is None:
        return None
    peer = peer_rank(pg, "isend", dst, group_dst, "dst")
    a, dev = array_in(tensor, "isend", "tensor", pg.context)
    return pg.engines[dev].run("send", True, a, peer, check_tag(tag, "isend", pg.context))


def irecv(tensor: Array, src: int | None = None, group: GroupArg = None, tag: int = 0,
          group_src: int | None = None) -> Work | None:
    """Start receiving into ``tensor`` from rank ``src`` (any rank if None); return a Work
    whose ``source_rank()`` tells the sender."""
    pg = resolve(group, "irecv")
    if pg is None:
        return None
    peer = peer_rank(pg, "irecv", src, group_src, "src", any_source=True)
    a, dev = array_out(tensor, "irecv", "tensor", pg.context)
    return pg.engines[dev].run("recv", True, a, peer, check_tag(tag, "irecv", pg.context))


def send(tensor: Array, dst: int | None = None, group: GroupArg = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    """Send ``tensor`` to rank ``dst`` and wait until the buffer can be reused."""
    if direct.send(tensor, dst, group, tag, group_dst):
        return None   # the compiled path ran it (see spmd.backends.mpi.fastcall.direct)
    pg = resolve(group, "send")
    if pg is None:
        return None
    peer = peer_rank(pg, "send", dst, group_dst, "dst")
    tag = check_tag(tag, "send", pg.context)
    a, dev = array_in(tensor, "send", "tensor", pg.context)
    return pg.engines[dev].run("send", False, a, peer, tag)


def recv(tensor: Array, src: int | None = None, group: GroupArg = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Receive into ``tensor`` from rank ``src`` (any rank if None).

    Returns:
        The global rank of the sender (-1 on a rank outside ``group``).
    """
    if src is not None and direct.recv(tensor, src, group, tag, group_src):
        return src     # the compiled path ran it (from any source, the Work says who sent)
    pg = resolve(group, "recv")
    if pg is None:
        return -1
    peer = peer_rank(pg, "recv", src, group_src, "src", any_source=True)
    tag = check_tag(tag, "recv", pg.context)
    a, dev = array_out(tensor, "recv", "tensor", pg.context)
    engine = pg.engines[dev]
    if peer is None:   # from any source: the Work says who sent it
        return engine.run("recv", True, a, peer, tag).source_rank()
    engine.run("recv", False, a, peer, tag)
    return pg.context.global_rank(peer)


class P2POp:
    """One send or receive of a :func:`batch_isend_irecv` batch.

    Args:
        op: ``spmd.isend`` or ``spmd.irecv``.
        tensor: the array to send or receive into.
        peer: the other side's global rank (or ``group_peer``, its group rank).
    """

    __slots__ = ("op", "tensor", "peer", "group", "tag", "group_peer")

    def __init__(self, op: Callable[..., Work | None], tensor: Array, peer: int | None = None,
                 group: GroupArg = None, tag: int = 0, group_peer: int | None = None):
        if op not in (isend, irecv):
            raise ValueError("P2POp: op must be spmd.isend or spmd.irecv, got "
                             f"{getattr(op, '__name__', op)!r}")
        self.op, self.tensor, self.peer, self.group = op, tensor, peer, group
        self.tag, self.group_peer = tag, group_peer

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__}, peer={self.peer}, group_peer={self.group_peer}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work | None]:
    """Start every send and receive of the list; return their Works in the same order.

    Every operation is checked before any is started, so a bad entry sends nothing.
    """
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError("batch_isend_irecv: expected a non-empty list of P2POp")
    started: list[tuple | None] = []
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise TypeError(f"batch_isend_irecv: entry {i} is {type(p).__name__}, expected P2POp")
        name = "isend" if p.op is isend else "irecv"
        pg = resolve(p.group, "batch_isend_irecv")
        if pg is None:
            started.append(None)
            continue
        sending = p.op is isend
        peer = peer_rank(pg, f"batch_isend_irecv[{i}] {name}", p.peer, p.group_peer, "peer")
        check = array_in if sending else array_out
        a, dev = check(p.tensor, f"batch_isend_irecv[{i}] {name}", "tensor", pg.context)
        started.append((pg.engines[dev], sending, a, peer,
                        check_tag(p.tag, "batch_isend_irecv", pg.context)))
    # One batch per engine: NCCL must see a group's sends and receives together.
    works: list[Work | None] = [None] * len(started)
    batches: dict = {}
    for i, item in enumerate(started):
        if item is not None:
            engine, sending, a, peer, tag = item
            positions, ops = batches.setdefault(id(engine), (engine, [], []))[1:]
            positions.append(i)
            ops.append(P2PItem(sending, a, peer, tag))
    for engine, positions, ops in batches.values():
        for i, work in zip(positions, engine.batch_p2p(ops)):
            works[i] = work
    return works
