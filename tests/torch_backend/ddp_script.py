"""An ordinary DDP training script: the only spmd-specific thing is the backend name.

Run under ``mpiexec -n N`` or ``srun`` with no MASTER_ADDR/RANK/WORLD_SIZE set.  Each
rank starts from different weights; DDP's broadcast and gradient all-reduce must
leave every rank with the same model, equal to one process training on the whole
batch (checked here against such a reference computed on every rank).
"""

import torch
import torch.distributed as dist
from _device_arg import device_from_args
from torch import nn

dev = device_from_args()  # cpu, or cuda on a GPU machine (tests/gpu/run.sh)
dist.init_process_group("spmd")
rank, world = dist.get_rank(), dist.get_world_size()


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).double().to(dev)


ref = make_model(0)  # rank 0's initial weights, which DDP broadcasts to every rank
model = nn.parallel.DistributedDataParallel(make_model(rank))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
per_rank = 4
for step in range(5):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(world * per_rank, 16, generator=g, dtype=torch.float64).to(dev), \
        torch.randn(world * per_rank, 4, generator=g, dtype=torch.float64).to(dev)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    opt.zero_grad()
    nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    opt.step()
    ref_opt.zero_grad()
    nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()
for p, q in zip(model.module.parameters(), ref.parameters()):
    torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    everyone = [torch.empty_like(p) for _ in range(world)]
    dist.all_gather(everyone, p.detach())
    assert all(torch.equal(e, p) for e in everyone)
print(f"rank {rank} of {world}: DDP matches single-process training", flush=True)
dist.destroy_process_group()
