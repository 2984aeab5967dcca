"""A tiny PyTorch Lightning training run on CPU under ``mpiexec -n N``, with
``DDPStrategy(process_group_backend=BACKEND)`` (spmd, or gloo for the reference).

    mpiexec -n N python tests/programs/lightning_trainer.py spmd|gloo OUTDIR

Lightning finds the ranks through mpi4py (its MPIEnvironment: under mpiexec it sets
MASTER_ADDR/MASTER_PORT itself and passes rank and world size to torch); the address is
pinned to 127.0.0.1 so that gloo's traffic stays on the loopback.  Every rank writes
its initial and final weights (float64, as JSON, which round-trips them exactly) and
the backend its process group had to OUTDIR/rank<R>.json.
"""

import json
import os
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.environments import MPIEnvironment
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class LoopbackMPIEnvironment(MPIEnvironment):
    """Lightning's MPIEnvironment, with rank 0's address said as 127.0.0.1."""

    def _get_main_address(self) -> str:
        return "127.0.0.1"


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).double()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    backend = sys.argv[1]
    env = LoopbackMPIEnvironment()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 8, generator=g, dtype=torch.float64),
                         torch.randn(48, 2, generator=g, dtype=torch.float64))
    model = Tiny()
    initial = torch.cat([p.detach().flatten() for p in model.parameters()])
    trainer = pl.Trainer(accelerator="cpu", devices=env.world_size(), num_nodes=1,
                         strategy=DDPStrategy(process_group_backend=backend), plugins=[env],
                         max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         deterministic=True)
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=False))
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    rank, world = trainer.global_rank, trainer.world_size
    result = {"rank": rank, "world": world, "mpi_rank": env.global_rank(),
              "group": type(dist.group.WORLD).__name__, "backend": dist.get_backend(),
              "initial": initial.tolist(), "weights": weights.tolist()}
    with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
