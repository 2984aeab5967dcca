"""Per-call overhead of spmd's blocking all_reduce against mpi4py's blocking Allreduce.

Run: mpiexec -n 2 python benchmarks/overhead.py [--bytes 8] [--iters 20000] [--repeats 9]

Both are timed side by side in one run, on the same buffer, alternating in rounds so
machine noise hits both alike; rank 0 prints medians and their ratio.
"""

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import spmd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    spmd.init_process_group()
    comm = spmd.GroupMember.WORLD.comm  # same private communicator spmd uses
    x = np.ones(max(1, args.bytes // 8), np.float64)

    def raw():
        comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)

    def ours():
        spmd.all_reduce(x)

    results = {"mpi4py Allreduce": [], "spmd all_reduce": []}
    for _ in range(args.repeats):
        for name, fn in (("mpi4py Allreduce", raw), ("spmd all_reduce", ours)):
            for _ in range(200):
                fn()
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                fn()
            results[name].append((time.perf_counter() - t0) / args.iters * 1e6)
    if spmd.get_rank() == 0:
        print(f"all_reduce {x.nbytes} B, {spmd.get_world_size()} ranks, "
              f"{args.repeats} rounds x {args.iters} calls")
        med = {k: statistics.median(v) for k, v in results.items()}
        for k, v in med.items():
            print(f"  {k:18s} median {v:7.3f} us  (min {min(results[k]):.3f}, max {max(results[k]):.3f})")
        print(f"  ratio spmd/mpi4py: {med['spmd all_reduce'] / med['mpi4py Allreduce']:.3f}")
    spmd.destroy_process_group()


if __name__ == "__main__":
    main()
