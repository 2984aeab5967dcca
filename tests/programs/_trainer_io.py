"""What the DeepSpeed and Megatron programs share: the launcher's ranks (from mpi4py)
into torch's variables, and each rank's result written to OUTDIR/rank<R>.json."""

import json
import os

import torch.distributed as dist
from mpi4py import MPI


def ranks_from_mpi(port: str) -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK from MPI; MASTER_ADDR 127.0.0.1 and ``port`` (the
    test's free one): what a trainer's launch script sets, so that no trainer picks a
    fixed port that two jobs on one host would share."""
    world = MPI.COMM_WORLD
    os.environ.update(RANK=str(world.Get_rank()), WORLD_SIZE=str(world.Get_size()),
                      LOCAL_RANK=str(world.Get_rank()), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port)


def finish(outdir: str, result: dict) -> None:
    """Write this rank's ``result`` and end torch.distributed on every rank."""
    with open(os.path.join(outdir, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
