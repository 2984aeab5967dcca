"""DTensor redistribution on the spmd backend, every value checked against numpy.

Shard(0) -> Replicate -> Shard(1) on a 1-D mesh of every rank (uneven shards: the
world size does not divide the dimensions), then Partial -> Replicate (an all-reduce of
per-rank values) and Partial -> Shard(0) (a reduce-scatter).
"""

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

dist.init_process_group("spmd")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
assert dist.get_backend(mesh.get_group()) == "spmd", dist.get_backend(mesh.get_group())

rows, cols = 2 * world + 1, 3 * world + 2  # not divisible: uneven shards


def shard(a, axis):
    """This rank's piece of ``a`` as DTensor's Shard cuts it: torch.chunk's sizes
    (ceil(n / world) each, the last ones short or empty), not np.array_split's."""
    size = -(-a.shape[axis] // world)
    return np.take(a, range(min(rank * size, a.shape[axis]),
                            min((rank + 1) * size, a.shape[axis])), axis=axis)


glob = np.arange(rows * cols, dtype=np.float64).reshape(rows, cols) * 0.5 - 3.0
full = torch.from_numpy(glob.copy())

d0 = distribute_tensor(full, mesh, [Shard(0)])
np.testing.assert_array_equal(d0.to_local().numpy(), shard(glob, 0))
rep = d0.redistribute(mesh, [Replicate()])
np.testing.assert_array_equal(rep.to_local().numpy(), glob)
d1 = rep.redistribute(mesh, [Shard(1)])
np.testing.assert_array_equal(d1.to_local().numpy(), shard(glob, 1))
np.testing.assert_array_equal(d1.full_tensor().numpy(), glob)

# Partial: every rank holds its own addend of the logical tensor.
mine = glob * (rank + 1) + rank
want = sum(glob * (r + 1) + r for r in range(world))
part = DTensor.from_local(torch.from_numpy(mine.copy()), mesh, [Partial()])
np.testing.assert_allclose(part.redistribute(mesh, [Replicate()]).to_local().numpy(), want,
                           rtol=1e-14)
part = DTensor.from_local(torch.from_numpy(mine.copy()), mesh, [Partial()])
np.testing.assert_allclose(part.redistribute(mesh, [Shard(0)]).to_local().numpy(),
                           shard(want, 0), rtol=1e-14)
avg = DTensor.from_local(torch.from_numpy(mine.copy()), mesh, [Partial("avg")])
np.testing.assert_allclose(avg.redistribute(mesh, [Replicate()]).to_local().numpy(),
                           want / world, rtol=1e-14)
print(f"rank {rank} of {world}: DTensor redistribute matches numpy", flush=True)
dist.destroy_process_group()
