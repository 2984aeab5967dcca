"""all_reduce of a large float32 cupy array: NCCL, or MPI through staging / GPU-aware MPI.

Run (GPU machine):
  python benchmarks/gpu_allreduce.py --backend nccl                  # world size 1
  SPMD_CUDA_AWARE_MPI=0 mpiexec -n 2 python benchmarks/gpu_allreduce.py --backend mpi

Rank 0 prints one table row per repeat and the median: time per call, algorithm
bandwidth (bytes / time) and bus bandwidth (x 2(n-1)/n, NCCL's convention).
"""

import argparse
import statistics
import time

import spmd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["nccl", "mpi"], default="nccl")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import cupy as cp

    spmd.init_process_group(backend=f"cpu:mpi,cuda:{args.backend}")
    n = spmd.get_world_size()
    x = cp.ones(args.mib * 2**20 // 4, cp.float32)
    nbytes = x.nbytes
    spmd.all_reduce(x)  # creates the communicator / pinned buffers
    cp.cuda.get_current_stream().synchronize()
    backend = spmd.GroupMember.WORLD.engine_for("cuda")
    how = type(backend).__name__
    if args.backend == "mpi":
        how += " (direct, GPU-aware MPI)" if backend.direct else " (pinned host staging)"
    times = []
    for _ in range(args.repeats):
        spmd.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            spmd.all_reduce(x)
        cp.cuda.get_current_stream().synchronize()
        times.append((time.perf_counter() - t0) / args.iters)
    if spmd.get_rank() == 0:
        print(f"all_reduce float32 {args.mib} MiB, {n} rank(s), {how}")
        print(f"  {'ms/call':>9s} {'algbw GB/s':>11s} {'busbw GB/s':>11s}")
        rows = [(f"repeat {i}", t) for i, t in enumerate(times)]
        for label, t in rows + [("median", statistics.median(times))]:
            bus = nbytes / t * (2 * (n - 1) / n if n > 1 else 1) / 1e9
            print(f"  {t * 1e3:9.2f} {nbytes / t / 1e9:11.2f} {bus:11.2f}  {label}")
    spmd.destroy_process_group()


if __name__ == "__main__":
    main()
