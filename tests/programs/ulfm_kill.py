"""A rank SIGKILLs itself at a chosen point; the survivors must get ProcessFailedError
naming it, shrink the default group and go on with right results.

    mpiexec --with-ft ulfm -n N python tests/programs/ulfm_kill.py POINT

POINT: where the victim (the last rank) dies while the others are
  collective  inside an all_reduce of WORLD
  between     between two ops (the survivors compute, then call the next op)
  idle        while nobody waits on MPI (the watchdog must find it: get_failed_ranks()
              knows it before any op is called)
  work        while the survivors wait on the Work of an async all_reduce
  p2p         while rank 0 receives from it (the others are in a barrier)
  object      inside an all_gather_object
  barrier     inside a barrier
  shm         inside a large all_reduce on the shared-memory engine
  subgroup    inside an all_reduce of a subgroup (it and its neighbour); the other
              subgroup finishes its own, then meets the failure at its next op of WORLD
  shrink_subgroup  inside an all_reduce of its subgroup (every rank but 0); its other
              members shrink that subgroup and reduce on it before all shrink WORLD

Each survivor prints one line ``RESULT {json}`` that the test checks: the error, its
failed ranks, the detection time, the shrunk world, and an all_reduce on it compared
with numpy here.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time

import numpy as np

import spmd as dist

POINT = sys.argv[1]
# A rank still here after 60 s is stuck: print every thread's stack and end it (the
# test's own limit is 90 s), so a hang shows where it is.
faulthandler.dump_traceback_later(60, exit=True)
dist.init_process_group()
rank, size = dist.get_rank(), dist.get_world_size()
victim = size - 1
N = 2 * 1024 * 1024 if POINT == "shm" else 16   # 16 MiB of float64: the shm engine's size


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def before_death() -> None:
    """What each rank runs before the kill: two healthy ops, checked."""
    x = np.full(N, rank + 1.0)
    dist.all_reduce(x)
    assert np.all(x == size * (size + 1) / 2), x[:4]
    dist.barrier()


# subgroup: the victim and its neighbour form one group, the other ranks another;
# shrink_subgroup: rank 0 alone, and ranks 1.. with the victim
PARTS = ([list(range(size - 2)), [size - 2, size - 1]] if POINT == "subgroup"
         else [[0], list(range(1, size))])
sub = (dist.new_subgroups_by_enumeration(PARTS)[0]
       if POINT in ("subgroup", "shrink_subgroup") else None)
before_death()
if rank == victim:
    time.sleep(0.2)   # the others are inside the op by now
    die()

t0 = time.monotonic()
error: BaseException | None = None
detail: dict = {}
try:
    if POINT == "collective":
        dist.all_reduce(np.ones(N))
    elif POINT == "between":
        time.sleep(1.0)
        dist.all_reduce(np.ones(N))
    elif POINT == "idle":
        time.sleep(2.5)   # the watchdog ticks each second
        detail["known_before_any_op"] = dist.get_failed_ranks()
        t0 = time.monotonic()
        dist.all_reduce(np.ones(N))
    elif POINT == "work":
        work = dist.all_reduce(np.ones(N), async_op=True)
        work.wait()
    elif POINT == "p2p":
        if rank == 0:
            dist.recv(np.empty(N), src=victim)
        else:
            dist.barrier()
    elif POINT == "object":
        out: list = [None] * size
        dist.all_gather_object(out, {"rank": rank})
    elif POINT == "barrier":
        dist.barrier()
    elif POINT == "shm":
        dist.all_reduce(np.ones(N))
    elif POINT == "subgroup":
        assert sub is not None
        y = np.full(N, rank + 1.0)
        dist.all_reduce(y, group=sub)
        # the group without the victim finishes its op, with the right sum
        part = PARTS[0] if rank in PARTS[0] else PARTS[1]
        detail["subgroup_sum_ok"] = bool(np.all(y == sum(r + 1.0 for r in part)))
        dist.all_reduce(np.ones(N))
    elif POINT == "shrink_subgroup":
        assert sub is not None
        dist.all_reduce(np.ones(N), group=sub if rank > 0 else None)
    else:
        raise SystemExit(f"unknown point {POINT}")
except dist.ProcessFailedError as exc:
    error = exc
detected = time.monotonic() - t0

result: dict = {"rank": rank, "point": POINT, **detail}
if error is None:
    result["error"] = None
else:
    result.update(error=type(error).__name__, failed=error.failed_ranks,
                  group=error.group, detect_s=round(detected, 3))
    # Every later op on the failed group raises the same error at once.
    try:
        dist.all_reduce(np.ones(4))
        result["then"] = "no error"
    except dist.ProcessFailedError as again:
        result["then"] = again.failed_ranks
    if POINT == "shrink_subgroup" and rank > 0:
        # the victim's subgroup without it, made from the survivors' communicator
        assert sub is not None
        smaller = dist.shrink_group(dist.get_failed_ranks(sub), sub)
        y = np.full(4, rank + 0.0)
        dist.all_reduce(y, group=smaller)
        result["subgroup_shrunk"] = [smaller.ranks, bool(np.all(y == sum(range(1, size - 1))))]
    t1 = time.monotonic()
    dist.shrink_group(dist.get_failed_ranks())
    result["shrink_s"] = round(time.monotonic() - t1, 3)
    new_rank, new_size = dist.get_rank(), dist.get_world_size()
    x = np.arange(8.0) * (new_rank + 1)
    dist.all_reduce(x)
    expected = np.arange(8.0) * sum(r + 1 for r in range(new_size))
    out = [None] * new_size
    dist.all_gather_object(out, new_rank)
    result.update(new_rank=new_rank, new_size=new_size,
                  sum_ok=bool(np.array_equal(x, expected)), gathered=out)
# One write() per line: lines of ranks that print together never interleave.
os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())
dist.destroy_process_group()
