"""Mismatched collectives under SPMD_DEBUG=DETAIL: every rank must raise
CollectiveMismatchError (and the group stays usable).  Run with 2+ ranks."""
import numpy as np

import spmd

spmd.init_process_group()
rank, n = spmd.get_rank(), spmd.get_world_size()
assert spmd.get_debug_level() == spmd.DebugLevel.DETAIL
last = n - 1


def case(name, call):
    try:
        call()
    except spmd.CollectiveMismatchError as exc:
        print(f"rank {rank} {name}: {exc}", flush=True)
    else:
        print(f"rank {rank} {name}: NO ERROR", flush=True)
    y = np.ones(3)
    spmd.all_reduce(y)  # the group is still in step
    assert y[0] == n, y


case("shape", lambda: spmd.all_reduce(np.ones(4 if rank == last else 3)))
case("dtype", lambda: spmd.all_reduce(np.ones(3, np.float32 if rank == last else np.float64)))
case("op", lambda: spmd.all_reduce(np.ones(3)) if rank != last else spmd.broadcast(np.ones(3), src=0))
case("root", lambda: spmd.broadcast(np.ones(3), src=0 if rank != last else 1))
case("reduce_op", lambda: spmd.all_reduce(np.ones(3), op=spmd.ReduceOp.MAX if rank == last else spmd.ReduceOp.SUM))
print(f"rank {rank} done", flush=True)
spmd.destroy_process_group()
