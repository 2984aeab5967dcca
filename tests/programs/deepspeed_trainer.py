"""DeepSpeed ZeRO (stages 1 and 2, fp32) training a small MLP on CPU under ``mpiexec -n N``,
on the "spmd" backend or on gloo (the reference).

    mpiexec -n N python tests/programs/deepspeed_trainer.py spmd|gloo STAGES PORT OUTDIR

STAGES is a comma-separated list ("1,2"): one job trains the same model from the same
start once per stage, each with an engine of its own (starting DeepSpeed costs more than
training it here).

``deepspeed.init_distributed(dist_backend=BACKEND)`` starts torch.distributed.  The
ranks come from mpi4py into RANK, WORLD_SIZE and LOCAL_RANK, with MASTER_ADDR 127.0.0.1
and the test's free PORT: left to find the ranks itself under mpiexec, DeepSpeed takes
its fixed port 29500, which two jobs at once would share.  DS_ACCELERATOR=cpu picks
DeepSpeed's CPU accelerator; a torch optimizer (SGD) keeps DeepSpeed's own CPU ops,
which compile on first use, out of it.  Every rank writes, per stage, its initial and
final weights (float32 values, as JSON, which round-trips them exactly), and the backend
its process group had, to OUTDIR/rank<R>.json.
"""

import os
import sys

os.environ["DS_ACCELERATOR"] = "cpu"

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _trainer_io import finish, ranks_from_mpi  # noqa: E402
from torch import nn  # noqa: E402

STEPS = 10
MICRO_BATCH = 4


def train(stage: int, rank: int, n: int) -> dict:
    """ZeRO ``stage`` on a fresh model: its initial and final weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    initial = torch.cat([p.detach().flatten() for p in model.parameters()])
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH,
              "train_batch_size": MICRO_BATCH * n,
              "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, n, MICRO_BATCH, 8, generator=g)
    ys = torch.randn(STEPS, n, MICRO_BATCH, 2, generator=g)
    for step in range(STEPS):
        loss = nn.functional.mse_loss(engine(xs[step, rank]), ys[step, rank])
        engine.backward(loss)
        engine.step()
    weights = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    return {"stage": engine.zero_optimization_stage(), "initial": initial.tolist(),
            "weights": weights.tolist()}


def main() -> None:
    backend, stages, port, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    ranks_from_mpi(port)
    deepspeed.init_distributed(dist_backend=backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "world": n,
              "group": type(dist.group.WORLD).__name__, "backend": dist.get_backend(),
              "stages": [train(int(stage), rank, n) for stage in stages.split(",")]}
    finish(out, result)


if __name__ == "__main__":
    main()
