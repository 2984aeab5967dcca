"""spmd's tour as a program: run with `mpiexec -n 4 python examples/quickstart.py`.

Every rank checks its own results; rank 0 prints a table of the checks and on how many
ranks each passed, then every rank prints one line.
"""
import sys

import numpy as np

import spmd as dist

dist.init_process_group()                      # ranks and size come from the MPI launcher
rank, world = dist.get_rank(), dist.get_world_size()
checks = {}                                    # check -> passed here (None: not run here)

x = np.full(4, rank, dtype=np.float32)         # collectives work in place on numpy arrays
dist.all_reduce(x, op=dist.ReduceOp.SUM)
checks["all_reduce (SUM, in place)"] = bool((x == sum(range(world))).all())

w = np.arange(3.0) if rank == 0 else np.zeros(3)
dist.broadcast(w, src=0)                       # src is a global rank, as in torch
checks["broadcast from rank 0"] = bool((w == np.arange(3.0)).all())

out = np.empty(2 * world, dtype=np.int64)      # every rank's piece, concatenated
dist.all_gather_into_tensor(out, np.array([rank, rank], dtype=np.int64))
checks["all_gather_into_tensor"] = bool((out == np.repeat(np.arange(world), 2)).all())

grad = np.ones(world * 2)
shard = np.empty(2)
work = dist.reduce_scatter_tensor(shard, grad, async_op=True)   # returns a Work
work.wait()                                     # ... overlap computation before this
checks["reduce_scatter_tensor (async)"] = bool((shard == world).all())

checks["isend/irecv around a ring"] = None
if world > 1:                                   # point to point around a ring
    ring = np.zeros(1)
    reqs = [dist.isend(np.array([float(rank)]), dst=(rank + 1) % world),
            dist.irecv(ring, src=(rank - 1) % world)]
    for r in reqs:
        r.wait()
    checks["isend/irecv around a ring"] = bool(ring[0] == (rank - 1) % world)

evens = dist.new_group([r for r in range(world) if r % 2 == 0])  # a subgroup
checks["all_reduce on new_group(evens)"] = None
if rank % 2 == 0:
    y = np.ones(1)
    dist.all_reduce(y, group=evens)
    checks["all_reduce on new_group(evens)"] = bool(y[0] == len(range(0, world, 2)))

names = [None] * world                          # picklable objects too
dist.all_gather_object(names, f"rank-{rank}")
checks["all_gather_object"] = names == [f"rank-{r}" for r in range(world)]

everyone = [None] * world                       # every rank's checks, for the table
dist.all_gather_object(everyone, checks)
if rank == 0:
    rows = [f"quickstart on {world} rank(s)", f"  {'check':34s} passed on"]
    for name in checks:
        ran = [c[name] for c in everyone if c[name] is not None]
        rows.append(f"  {name:34s} " + (f"{sum(ran)}/{len(ran)} ranks" if ran else
                                        "- (needs 2 ranks)"))
    # One write for the whole table (well under the 4 KiB a pipe passes in one piece),
    # so no other rank's line lands inside it.
    sys.stdout.write("\n".join(rows) + "\n")
    sys.stdout.flush()
failed = sorted({n for c in everyone for n, ok in c.items() if ok is False})
if failed:
    raise AssertionError(f"rank {rank}/{world} quickstart: failed {failed}")
sys.stdout.write(f"rank {rank}/{world} quickstart OK\n")   # one write per line
sys.stdout.flush()
dist.destroy_process_group()
