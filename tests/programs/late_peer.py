"""After an op times out on one rank and its peer arrives late, the program's memory is
its own again: a timed-out receive is cancelled (the late message goes to the next
receive), a timed-out collective is held with its array (not written into arrays made
afterwards) and its peers' late calls raise GroupBrokenError instead of "succeeding".

    mpiexec -n N python late_peer.py CASE     (the group's timeout 1 s; rank 1 is the late one)

CASE: recv, all_reduce, all_reduce_view (the Python path), setup (the shared-memory
engine's first-use set-up), send.  Every rank prints "CASE ok" when what it saw is right.
"""

import gc
import re
import sys
import time
from datetime import timedelta

import numpy as np

import spmd
from spmd.backends.mpi import orphans

case = sys.argv[1]
spmd.init_process_group(timeout=timedelta(seconds=60))
rank, n = spmd.get_rank(), spmd.get_world_size()
LATE = 2.5   # seconds the late rank sleeps: past rank 0's timeout and its diagnosis
# The group the case breaks, with a 1 s timeout; WORLD stays whole for the end.
pg = spmd.new_group(list(range(n)), timeout=timedelta(seconds=1))
spmd.all_reduce(np.ones(1), group=pg)


def late_call_raises(call) -> None:
    """The late rank's call: it must raise GroupBrokenError (told by rank 0)."""
    time.sleep(LATE)
    try:
        call()
    except spmd.GroupBrokenError as exc:
        assert "told by rank" in str(exc), exc
    else:
        raise AssertionError(f"{case}: the late call succeeded on a group rank 0 gave up")


def times_out(call) -> tuple[str, bool]:
    """A waiting rank's call: its own diagnosed timeout (text, True), or, with two or more
    waiting ranks, the group broken by another waiting rank's timeout first (text, False):
    GroupBrokenError "(told by rank N)", N not the late rank."""
    try:
        call()
    except spmd.DistTimeoutError as exc:
        return str(exc), True
    except spmd.GroupBrokenError as exc:
        told = re.search(r"\(told by rank (\d+)\)", str(exc))
        assert n > 2 and told is not None and int(told.group(1)) != 1, str(exc)
        return str(exc), False
    raise AssertionError(f"{case}: no timeout on rank {rank}")


if case == "recv":
    # Rank 1 sends 1.0 late, then 2.0: the cancelled receive takes neither.
    if rank == 0:
        a = np.zeros(4)
        times_out(lambda: spmd.recv(a, src=1, group=pg))
        time.sleep(LATE + 0.5)              # the late message arrives meanwhile
        assert not a.any(), f"the cancelled receive wrote {a}"
        b, c = np.zeros(4), np.zeros(4)
        spmd.recv(b, src=1, group=pg)
        spmd.recv(c, src=1, group=pg)
        assert (b == 1).all() and (c == 2).all(), (b, c)
        assert pg.context.error is None     # a cancelled receive leaves the group usable
        assert orphans.held() == 0
    elif rank == 1:
        time.sleep(LATE)
        spmd.send(np.full(4, 1.0), dst=0, group=pg)
        spmd.send(np.full(4, 2.0), dst=0, group=pg)
elif case in ("all_reduce", "all_reduce_view", "setup"):
    size = {"all_reduce": 16, "all_reduce_view": 16, "setup": 32768}[case]
    if rank == 1:
        x = np.ones((size, 2))[:, 0] if case == "all_reduce_view" else np.ones(size)
        late_call_raises(lambda: spmd.all_reduce(x, group=pg))
        assert (x == 1).all()
    else:
        a = np.ones((size, 2))[:, 0] if case == "all_reduce_view" else np.ones(size)
        text, own = times_out(lambda: spmd.all_reduce(a, group=pg))
        if case == "setup" and own:
            assert "(timed out setting up the shared-memory engine)" in text, text
        assert orphans.held() >= 1, "the timed-out all_reduce's request was not held"
        del a
        gc.collect()
        fresh = [np.full(size, 7.0) for _ in range(64)]   # where a's memory would go
        time.sleep(LATE + 1.0)
        assert all((f == 7).all() for f in fresh), "a late result landed in a new array"
        try:
            spmd.all_reduce(np.ones(4), group=pg)
        except spmd.GroupBrokenError:
            pass
        else:
            raise AssertionError("the broken group took another op")
elif case == "send":
    # A send nobody receives in time (large: MPICH and Open MPI do not send it eagerly)
    # is held and the group breaks.  An MPI that buffers it (Intel MPI's shared-memory
    # path does, at 8 MB) completes the send: then nothing is given up, and the late
    # receive gets the data.  Each rank says which happened.
    big = 1 << 20
    buffered = np.zeros(1)
    if rank == 0:
        a = np.ones(big)
        try:
            spmd.send(a, dst=1, group=pg)
            buffered[0] = 1
        except spmd.DistTimeoutError:
            assert pg.context.error is not None and orphans.held() >= 1
    spmd.broadcast(buffered, src=0)   # on WORLD, which stays whole
    if rank == 1:
        b = np.zeros(big)
        if buffered[0]:
            spmd.recv(b, src=0, group=pg)
            assert (b == 1).all()
        else:
            late_call_raises(lambda: spmd.recv(b, src=0, group=pg))
            assert not b.any()
    if rank == 0:
        print("send " + ("buffered by MPI" if buffered[0] else "given up"), flush=True)
else:
    raise SystemExit(f"unknown case {case!r}")

if case in ("all_reduce", "all_reduce_view", "setup"):
    # WORLD is untouched: at least one waiting rank got the diagnosis itself
    owns = [None] * n
    spmd.all_gather_object(owns, own if rank != 1 else None)
    assert any(owns), owns
spmd.barrier()   # WORLD is untouched: every rank gets here
print(f"{case} ok", flush=True)
spmd.destroy_process_group()
