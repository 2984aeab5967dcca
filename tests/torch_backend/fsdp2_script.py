"""FSDP2 (``fully_shard``) training on the spmd backend, checked against one process.

Every rank builds the same MLP (seed 0), shards it with ``fully_shard`` and trains 3
steps on its slice of each batch; the reference is the unsharded model trained on the
whole batch in this process.  FSDP2 averages the reduce-scattered gradients, so the
gathered parameters must equal the reference's after every step.
"""

import torch
import torch.distributed as dist
from _device_arg import device_from_args
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

dev = device_from_args()  # cpu, or cuda on a GPU machine (tests/gpu/run.sh)
dist.init_process_group("spmd")
rank, world = dist.get_rank(), dist.get_world_size()


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(),
                         nn.Linear(32, 4)).double().to(dev)


ref = make_model()
model = make_model()
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer)
fully_shard(model)
assert all(isinstance(p, DTensor) for p in model.parameters())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
per_rank = 3
for step in range(3):
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randn(world * per_rank, 16, generator=g, dtype=torch.float64).to(dev)
    y = torch.randn(world * per_rank, 4, generator=g, dtype=torch.float64).to(dev)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    opt.zero_grad()
    nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    opt.step()
    ref_opt.zero_grad()
    nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        full = p.full_tensor()  # an all-gather over the shards
        torch.testing.assert_close(full, q.detach(), rtol=1e-10, atol=1e-12,
                                   msg=lambda m, n=name, s=step: f"step {s} {n}: {m}")
        assert not torch.equal(q.detach(), make_model().state_dict()[name]), \
            f"{name} did not change: the check could not fail"
print(f"rank {rank} of {world}: FSDP2 matches single-process training", flush=True)
dist.destroy_process_group()
