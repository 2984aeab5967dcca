"""spmd in 40 lines: run with `mpiexec -n 4 python examples/quickstart.py`."""
import numpy as np

import spmd as dist

dist.init_process_group()                      # ranks and size come from the MPI launcher
rank, world = dist.get_rank(), dist.get_world_size()

x = np.full(4, rank, dtype=np.float32)         # collectives work in place on numpy arrays
dist.all_reduce(x, op=dist.ReduceOp.SUM)
assert (x == sum(range(world))).all()

w = np.arange(3.0) if rank == 0 else np.zeros(3)
dist.broadcast(w, src=0)                       # src is a global rank, as in torch
assert (w == np.arange(3.0)).all()

out = np.empty(2 * world, dtype=np.int64)      # every rank's piece, concatenated
dist.all_gather_into_tensor(out, np.array([rank, rank], dtype=np.int64))
assert (out == np.repeat(np.arange(world), 2)).all()

grad = np.ones(world * 2)
shard = np.empty(2)
work = dist.reduce_scatter_tensor(shard, grad, async_op=True)   # returns a Work
work.wait()                                     # ... overlap computation before this
assert (shard == world).all()

if world > 1:                                   # point to point around a ring
    ring = np.zeros(1)
    reqs = [dist.isend(np.array([float(rank)]), dst=(rank + 1) % world),
            dist.irecv(ring, src=(rank - 1) % world)]
    for r in reqs:
        r.wait()
    assert ring[0] == (rank - 1) % world

evens = dist.new_group([r for r in range(world) if r % 2 == 0])  # a subgroup
if rank % 2 == 0:
    y = np.ones(1)
    dist.all_reduce(y, group=evens)
    assert y[0] == len(range(0, world, 2))

names = [None] * world                          # picklable objects too
dist.all_gather_object(names, f"rank-{rank}")
assert names == [f"rank-{r}" for r in range(world)]
print(f"rank {rank}/{world} quickstart OK", flush=True)
dist.destroy_process_group()
