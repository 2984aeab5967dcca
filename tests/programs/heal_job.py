"""Ranks are lost one after another (killed, or hung) and the job heals each time: the
survivors shrink WORLD, heal() starts new processes that take the lost ranks, and
heal_state() hands them the state; the final result equals the fault-free one.

    mpiexec --with-ft ulfm -n N python tests/programs/heal_job.py FAULT[,FAULT...]

FAULT: kill or stop, in order: at step 3 + 4k the rank N-1-k (mod N) meets fault k.
Every rank of the final world prints ``RESULT {json}``: its rank, whether it is a
replacement, the state's step count and sum, and, on rank 0, the times of each heal.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np

import spmd as dist


def say(line: str) -> None:
    """One write per line (the launcher can split a line written in two)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()

FAULTS = sys.argv[1].split(",")
STEPS = 3 + 4 * len(FAULTS) + 2
faulthandler.dump_traceback_later(120, exit=True)
dist.init_process_group(timeout=timedelta(seconds=3))
size = dist.get_world_size()


def fault_at(step: int) -> tuple[int, str] | None:
    """(the rank that meets a fault at this step, which), or None."""
    for k, how in enumerate(FAULTS):
        if step == 3 + 4 * k:
            return (size - 1 - k) % size, how
    return None


if dist.is_replacement():
    state = dist.heal_state(None)
else:
    state = {"step": 0, "w": np.zeros(4), "heals": []}
while state["step"] < STEPS:
    step = state["step"]
    fault = fault_at(step)
    if fault is not None and fault[0] == dist.get_rank() and not state.get(f"faulted{step}"):
        if fault[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGSTOP)
    g = np.full(4, float(step + 1))
    t0 = time.monotonic()
    try:
        dist.all_reduce(g)
    except dist.ProcessFailedError as err:
        detected = time.monotonic() - t0
        dist.shrink_group(err.group_ranks)
        t1 = time.monotonic()
        new = dist.heal()
        state[f"faulted{step}"] = True   # the replacement must not meet the fault again
        state["heals"].append({"step": step, "failed": list(err.failed_ranks), "new": new,
                               "detect": round(detected, 3), "shrink": round(t1 - t0 - detected, 3),
                               "heal": round(time.monotonic() - t1, 3)})
        state = dist.heal_state(state)
        continue   # redo the step on the full world
    state["w"] += g / dist.get_world_size()
    state["step"] = step + 1
dist.barrier()
# Layouts rebuilt on the healed world are the ones from before: a 2 x (size/2) mesh's
# groups hold the same ranks, and reduce right.
mesh = dist.init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("dp", "tp"))
groups = {}
for dim in ("dp", "tp"):
    pg = mesh.get_group(dim)
    groups[dim] = dist.get_process_group_ranks(pg)
    v = np.full(2, float(dist.get_rank()))
    dist.all_reduce(v, group=pg)
    assert (v == sum(groups[dim])).all(), (dim, v, groups[dim])
say("RESULT " + json.dumps({"rank": dist.get_rank(), "size": dist.get_world_size(),
                            "replacement": dist.is_replacement(), "step": state["step"],
                            "w": state["w"].tolist(), "heals": state["heals"],
                            "mesh": groups}))
