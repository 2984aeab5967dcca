"""Mismatched collectives under SPMD_DEBUG=DETAIL: every rank must raise
CollectiveMismatchError (and the group stays usable).  Run with 2+ ranks.

Rank 0 prints every rank's outcome, one line each ("rank R CASE: message"), so the
lines of different ranks cannot interleave."""
import numpy as np

import spmd

spmd.init_process_group()
rank, n = spmd.get_rank(), spmd.get_world_size()
assert spmd.get_debug_level() == spmd.DebugLevel.DETAIL
last = n - 1
outcomes = []


def case(name, call):
    try:
        call()
    except spmd.CollectiveMismatchError as exc:
        outcomes.append(f"rank {rank} {name}: " + str(exc).replace("\n", " |"))
    else:
        outcomes.append(f"rank {rank} {name}: NO ERROR")
    y = np.ones(3)
    spmd.all_reduce(y)  # the group is still in step
    assert y[0] == n, y


case("shape", lambda: spmd.all_reduce(np.ones(4 if rank == last else 3)))
case("dtype", lambda: spmd.all_reduce(np.ones(3, np.float32 if rank == last else np.float64)))
case("op", lambda: spmd.all_reduce(np.ones(3)) if rank != last else spmd.broadcast(np.ones(3), src=0))
case("root", lambda: spmd.broadcast(np.ones(3), src=0 if rank != last else 1))
case("reduce_op", lambda: spmd.all_reduce(np.ones(3), op=spmd.ReduceOp.MAX if rank == last else spmd.ReduceOp.SUM))
outcomes.append(f"rank {rank} done")
everyone = [None] * n
spmd.all_gather_object(everyone, outcomes)
if rank == 0:
    print("\n".join(line for lines in everyone for line in lines), flush=True)
spmd.destroy_process_group()
