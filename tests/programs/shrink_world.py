"""Shrinking the default group, on any MPI.

    mpiexec -n 4 python tests/programs/shrink_world.py CKPT_DIR

Ranks 2 and 3 (the second tensor-parallel replica) leave; ranks 0 and 1 shrink WORLD,
rebuild parallel_state (tp 2, dp 2 -> 1) and a (dp, tp) DeviceMesh (2x2 -> 1x2), reduce
with a BucketReducer and load a checkpoint saved by the 4-rank world; each prints ``RESULT {json}``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import spmd as dist
from spmd import parallel_state as ps
from spmd.checkpoint import load, save


def planned(ckpt: str) -> None:
    dist.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    assert ps.get_data_parallel_world_size() == size // 2
    old_tp = ps.get_tensor_model_parallel_group()
    mesh = dist.init_device_mesh("cpu", (size // 2, 2), mesh_dim_names=("dp", "tp"))
    save({"w": np.arange(6.0), "step": 3}, ckpt)
    if rank >= 2:
        return           # leaves: excluded ranks do not call shrink_group
    world = dist.shrink_group([2, 3])
    result: dict = {"rank": rank, "new_rank": dist.get_rank(),
                    "new_size": dist.get_world_size(),
                    "is_default": world is dist.GroupMember.WORLD,
                    "layout_dropped": not ps.model_parallel_is_initialized()}
    try:
        dist.all_reduce(np.zeros(1), group=old_tp)
        result["old_tp"] = "works"
    except RuntimeError as exc:
        result["old_tp"] = type(exc).__name__
    ps.rebuild_model_parallel()
    result.update(tp=ps.get_tensor_model_parallel_world_size(),
                  dp=ps.get_data_parallel_world_size())
    x = np.full(4, dist.get_rank() + 1.0)
    dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())
    result["tp_sum_ok"] = bool(np.all(x == 3.0))
    grads = [np.full(5, dist.get_rank() + 1.0), np.full(3, 10.0 * (dist.get_rank() + 1))]
    reducer = dist.BucketReducer(grads, group=ps.get_tensor_model_parallel_group())
    for i in reversed(range(len(grads))):
        reducer.mark_ready(i)
    reducer.wait()
    result["reducer_ok"] = bool(np.all(grads[0] == 1.5) and np.all(grads[1] == 15.0))
    got = load({"w": np.zeros(6), "step": 0}, ckpt)
    mesh = dist.rebuild_device_mesh(mesh, "dp")
    z = np.full(2, dist.get_rank() + 1.0)
    dist.all_reduce(z, group=mesh.get_group("tp"))
    result["mesh"] = [list(mesh.shape), bool(np.all(z == 3.0))]
    result["ckpt_ok"] = bool(np.array_equal(got["w"], np.arange(6.0)) and got["step"] == 3)
    # One write() per line: lines of ranks that print together never interleave.
    os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    planned(sys.argv[1])
