"""A script written for torch's "mpi" backend, run under ``mpiexec -n N`` with
``SPMD_TORCH_MPI=1`` on a torch built without MPI: spmd answers to the name.

Checks on every rank: ranks and size are MPI's (no MASTER_ADDR, RANK or WORLD_SIZE
set), the groups are spmd's and torch calls them "mpi", the timeout given reaches them,
an all-reduce, a subgroup made with ``new_group(backend="mpi")``, an object collective
and a few DDP steps equal to one process training on the whole batch.
"""

import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

assert "MASTER_ADDR" not in os.environ and "RANK" not in os.environ
assert dist.is_mpi_available(), "is_mpi_available() is False with SPMD_TORCH_MPI=1"
comm = MPI.COMM_WORLD
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    # torch's MPI path ignores rank and world_size (Accelerate passes them), and says so.
    dist.init_process_group("mpi", timeout=timedelta(seconds=77), rank=comm.Get_rank(),
                            world_size=comm.Get_size())
assert any("are ignored since they are assigned by the MPI runtime" in str(w.message)
           for w in said), [str(w.message) for w in said]
rank, world = dist.get_rank(), dist.get_world_size()
assert (rank, world) == (comm.Get_rank(), comm.Get_size()), \
    f"torch says rank {rank} of {world}, MPI {comm.Get_rank()} of {comm.Get_size()}"
assert dist.get_backend() == "mpi", dist.get_backend()
pg = dist.group.WORLD
assert type(pg).__name__ == "SpmdProcessGroup", type(pg)
assert pg.spmd_group.timeout == timedelta(seconds=77), pg.spmd_group.timeout

t = torch.full((5,), float(rank + 1), dtype=torch.float64)
dist.all_reduce(t)
assert t.tolist() == [world * (world + 1) / 2] * 5, t

ends = sorted({0, world - 1})
sub = dist.new_group(ends, backend="mpi", timeout=timedelta(seconds=55))
if rank in ends:
    assert dist.get_backend(sub) == "mpi" and sub.size() == len(ends), (dist.get_backend(sub), sub)
    assert sub.spmd_group.timeout == timedelta(seconds=55), sub.spmd_group.timeout
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=sub)
    assert x.item() == float(sum(ends)), x
else:
    assert sub == dist.GroupMember.NON_GROUP_MEMBER, sub

gathered: list = [None] * world
dist.all_gather_object(gathered, {"rank": rank})
assert gathered == [{"rank": r} for r in range(world)], gathered


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).double()


ref = make_model(0)
model = nn.parallel.DistributedDataParallel(make_model(rank))
opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
for step in range(3):
    g = torch.Generator().manual_seed(10 + step)
    x = torch.randn(world * 3, 8, generator=g, dtype=torch.float64)
    y = torch.randn(world * 3, 2, generator=g, dtype=torch.float64)
    mine = slice(rank * 3, (rank + 1) * 3)
    for m, o, xs, ys in ((model, opt, x[mine], y[mine]), (ref, ref_opt, x, y)):
        o.zero_grad()
        nn.functional.mse_loss(m(xs), ys).backward()
        o.step()
for p, q in zip(model.module.parameters(), ref.parameters()):
    torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
dist.barrier()
dist.destroy_process_group()
print(f"rank {rank} of {world}: the \"mpi\" backend is spmd's", flush=True)
