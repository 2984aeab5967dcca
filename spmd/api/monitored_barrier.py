"""``monitored_barrier``: a barrier that names the ranks that did not arrive, and where
they are (torch's ``monitored_barrier``)."""

from __future__ import annotations

import time
import weakref
import zlib

from spmd.backends.mpi.control import TAG_BARRIER
from spmd.core.errors import DistTimeoutError
from spmd.core.timeouts import to_seconds
from spmd.core.typing import Timeout
from spmd.runtime import diagnosis, reliability
from spmd.runtime.group import GroupArg, resolve

__all__ = ["monitored_barrier"]

_barrier_counts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def monitored_barrier(group: GroupArg = None, timeout: Timeout | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that says which ranks did not arrive.

    Group rank 0 waits for every other member's arrival (over the control channel, not
    the group's communicator, so it works even when the group is out of step) and then
    releases them.  Every member must call it.

    Args:
        timeout: how long rank 0 waits for the others (the group's timeout if None).
        wait_all_ranks: name every missing rank, not only the first one.

    Raises:
        DistTimeoutError: on group rank 0, naming the missing rank(s) and where they are;
            on the other ranks, with rank 0's verdict (or when rank 0 does not answer).
    """
    op = "monitored_barrier"
    pg = resolve(group, op)
    if pg is None or pg.context.size == 1:
        return
    ctx = pg.context
    seconds = ctx.timeout if timeout is None else to_seconds(timeout, "monitored_barrier")
    ch = reliability.state.channel
    if ch is None:
        raise RuntimeError(f"{op}: the control channel is not running [rank {ctx.rank}, "
                           f"group {ctx.name}]")
    count = _barrier_counts.get(pg, 0) + 1
    _barrier_counts[pg] = count
    arrive = TAG_BARRIER + 2 * (zlib.crc32(f"{ctx.name}{ctx.ranks}".encode()) % 4096)
    root, me = ctx.ranks[0], ctx.ranks[ctx.rank]
    if me != root:
        ch.send({"count": count}, root, arrive)
        deadline = time.monotonic() + seconds + reliability.config().query_timeout + 5.0
        while time.monotonic() < deadline:
            msg = ch.receive(root, arrive + 1)
            if msg is None:
                time.sleep(0.001)
            elif msg["count"] == count:
                if msg.get("error"):
                    raise DistTimeoutError(msg["error"].replace(
                        f"[rank 0, group {ctx.name}]", f"[rank {ctx.rank}, group {ctx.name}]"))
                return
        text = diagnosis.diagnose(op, ctx, None, "barrier", seconds, "monitored_barrier")
        raise DistTimeoutError(f"{op}: {diagnosis.who(ctx, root)}, which runs the barrier, did "
                               f"not release this rank [rank {ctx.rank}, group {ctx.name}]\n"
                               + "\n".join(text.splitlines()[1:]))
    pending = list(ctx.ranks[1:])
    deadline = time.monotonic() + seconds
    while pending and time.monotonic() < deadline:
        for r in list(pending):
            msg = ch.receive(r, arrive)
            while msg is not None and msg["count"] < count:  # left by an earlier failure
                msg = ch.receive(r, arrive)
            if msg is not None:
                pending.remove(r)
        if pending:
            time.sleep(0.001)
    error = None
    if pending:
        named = pending if wait_all_ranks else pending[:1]
        request = {"q": "state", "group": diagnosis.group_key(ctx), "seq": None, "from": me,
                   "dump": False}
        replies = ch.query(named, request, reliability.config().query_timeout)
        who = ", ".join(diagnosis.who(ctx, r) for r in named)
        more = "" if wait_all_ranks or len(pending) == 1 else \
            f" (and {len(pending) - 1} more; wait_all_ranks=True names them all)"
        error = (f"{op}: {who} did not arrive within {seconds:g} s{more} "
                 f"[rank 0, group {ctx.name}]\n" +
                 "\n".join("  " + diagnosis.peer_text(ctx, r, replies.get(r), None, op)
                           for r in named))
    for r in ctx.ranks[1:]:
        ch.send({"count": count, "error": error}, r, arrive + 1)
    if error is not None:
        raise DistTimeoutError(error)
    return
