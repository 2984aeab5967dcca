"""A 2-D DeviceMesh on the spmd backend: ``init_device_mesh("cpu", (2, 2))`` at 4 ranks.

The groups of each mesh dimension must hold the ranks torch's layout gives them (the
mesh is ``arange(4).reshape(2, 2)``: dimension 0 groups are columns, dimension 1 groups
rows), and an all-reduce over each dimension must sum exactly those ranks' values.
A 2-D DTensor (Shard(0), Shard(1)) then goes to Replicate over both dimensions.
"""

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

dist.init_process_group("spmd")
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 4, f"mesh_script.py runs at 4 ranks, got {world}"
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
layout = np.arange(4).reshape(2, 2)
i, j = map(int, np.argwhere(layout == rank)[0])
assert list(mesh.get_coordinate()) == [i, j], (mesh.get_coordinate(), [i, j])
want = {"dp": [int(r) for r in layout[:, j]], "tp": [int(r) for r in layout[i, :]]}
for dim, name in enumerate(("dp", "tp")):
    group = mesh.get_group(name)
    assert group is mesh.get_group(dim) or dist.get_process_group_ranks(mesh.get_group(dim)) \
        == dist.get_process_group_ranks(group)
    assert dist.get_backend(group) == "spmd", dist.get_backend(group)
    ranks = dist.get_process_group_ranks(group)
    assert ranks == want[name], f"mesh dim {name}: ranks {ranks}, torch's layout {want[name]}"
    assert mesh[name].mesh.tolist() == want[name]
    assert dist.get_rank(group) == want[name].index(rank)
    x = torch.from_numpy(np.arange(5, dtype=np.int64) * 10 + rank ** 2 + 1)
    dist.all_reduce(x, group=group)
    ref = sum(np.arange(5, dtype=np.int64) * 10 + r ** 2 + 1 for r in want[name])
    np.testing.assert_array_equal(x.numpy(), ref)
    y = torch.full((3,), float(rank + 1), dtype=torch.float64)
    dist.all_reduce(y, op=dist.ReduceOp.MAX, group=group)
    np.testing.assert_array_equal(y.numpy(), np.full(3, max(want[name]) + 1.0))

glob = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)
d = distribute_tensor(torch.from_numpy(glob.copy()), mesh, [Shard(0), Shard(1)])
np.testing.assert_array_equal(d.to_local().numpy(), glob[3 * i:3 * i + 3, 4 * j:4 * j + 4])
np.testing.assert_array_equal(
    d.redistribute(mesh, [Replicate(), Replicate()]).to_local().numpy(), glob)
print(f"rank {rank} of {world}: DeviceMesh (2, 2) groups and all_reduce match", flush=True)
dist.destroy_process_group()
