"""DDP step time of one MLP, torch.distributed on spmd vs on gloo, in one mpiexec job.

    mpiexec -n 2 python benchmarks/ddp_step.py [--hidden 1024] [--steps 30]

Both runs train the same model (a few million float32 parameters) on the same data;
gloo's default group is set up over TCP on rank 0's host, spmd's is a group made
with new_group(backend="spmd") in the same job.  Rank 0 prints the median step time
(forward, backward with DDP's bucketed all-reduce, optimizer step) of each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from mpi4py import MPI

import spmd
import spmd.torch
from spmd.tools.bench import _Torch


def step_times(group, hidden: int, steps: int, warmup: int) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 16))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x, y = torch.randn(32, hidden), torch.randn(32, 16)
    times = []
    for i in range(warmup + steps):
        MPI.COMM_WORLD.Barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        t = MPI.COMM_WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if i >= warmup:
            times.append(t)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024, help="MLP width (default 1024: 2.1M params)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    spmd.init_process_group()
    comm = MPI.COMM_WORLD
    tt = _Torch(spmd.GroupMember.WORLD.comm, with_spmd=True)  # gloo default + spmd group
    results = {}
    for name, group in (("torch-gloo", None), ("torch-spmd", tt.spmd_group),
                        ("torch-gloo ", None), ("torch-spmd ", tt.spmd_group)):
        results.setdefault(name.strip(), []).extend(
            step_times(group, args.hidden, args.steps, args.warmup))
    params = sum(p.numel() for p in torch.nn.Sequential(
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.Linear(args.hidden, args.hidden),
        torch.nn.Linear(args.hidden, 16)).parameters())
    if comm.Get_rank() == 0:
        print(f"DDP step, {comm.Get_size()} ranks, MLP {params / 1e6:.1f}M params, batch 32/rank")
        for name, ts in results.items():
            print(f"  {name:11s} median {statistics.median(ts) * 1e3:8.2f} ms  "
                  f"p10 {sorted(ts)[len(ts) // 10] * 1e3:8.2f} ms  ({len(ts)} steps)")
    tt.close()
    spmd.destroy_process_group()


if __name__ == "__main__":
    main()
