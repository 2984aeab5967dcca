"""A tiny Hugging Face Accelerate training run in its multi-CPU mode under
``mpiexec -n N``: ``Accelerator(cpu=True)``, a DataLoader, ``prepare`` and
``accelerator.backward``, as Accelerate's own examples do.

    SPMD_TORCH_MPI=1 mpiexec -n N python tests/programs/accelerate_trainer.py OUTDIR
    MASTER_ADDR=127.0.0.1 MASTER_PORT=P mpiexec -n N python tests/programs/accelerate_trainer.py OUTDIR

Accelerate reads the ranks from the launcher's variables (PMI_RANK, OMPI_COMM_WORLD_RANK)
and picks torch's "mpi" backend where ``torch.distributed.is_mpi_available()``: spmd's
with SPMD_TORCH_MPI=1, else gloo (which needs MASTER_ADDR and MASTER_PORT).  Every rank
writes its initial and final weights (float64, as JSON, which round-trips them exactly)
and the backend Accelerate chose to OUTDIR/rank<R>.json.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).double()
    initial = torch.cat([p.detach().flatten() for p in model.parameters()])
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 8, generator=g, dtype=torch.float64),
                         torch.randn(48, 2, generator=g, dtype=torch.float64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=4, shuffle=False))
    for _epoch in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
    weights = torch.cat([p.detach().flatten()
                         for p in accelerator.unwrap_model(model).parameters()])
    state = accelerator.state
    rank = state.process_index
    result = {"rank": rank, "world": state.num_processes,
              "distributed_type": str(state.distributed_type), "backend": state.backend,
              "torch_backend": dist.get_backend(), "group": type(dist.group.WORLD).__name__,
              "initial": initial.tolist(), "weights": weights.tolist()}
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
