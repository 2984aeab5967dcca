"""Data-parallel step time: BucketReducer vs one all_reduce per gradient vs one after backward.

Run: mpiexec -n 4 python benchmarks/dp_step.py [--width 1024] [--layers 6] [--steps 12]

The model of examples/dp_mlp.py (numpy MLP, hand-written backward) made bigger:
``--layers`` layers of ``--width`` float32 units, ``--batch`` samples per rank.  Each
step is forward, backward and the gradient average; the ways to average:

- ``compute only``: no communication (the floor).
- ``reducer``: ``spmd.BucketReducer`` (``--cap`` MiB buckets, DDP's 1 MiB first
  bucket, ``gradient_as_bucket_view``), each bucket's all_reduce started during backward.
- ``per gradient``: ``all_reduce(g, async_op=True)`` for each gradient as soon as it
  is final, all waited after backward (no bucketing).
- ``after backward``: one ``all_reduce_coalesced`` of every gradient after backward
  (one fused collective, nothing overlapped).

Rank 0 prints the median step time of the slowest rank over ``--steps`` steps after
two warm-up steps, for each way in interleaved rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

import spmd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import _mlp


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--cap", type=float, default=4.0, help="bucket_cap_mb")
    args = parser.parse_args()
    spmd.init_process_group()
    rank, size = spmd.get_rank(), spmd.get_world_size()
    sizes = (args.width,) * (args.layers + 1)
    acts = _mlp.tanh_but_last(args.layers)
    params = [p.astype(np.float32) for p in _mlp.init_params(sizes, seed=1)]
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((args.batch, sizes[0]), dtype=np.float32)
    target = rng.standard_normal((args.batch, sizes[-1]), dtype=np.float32)
    reducer = spmd.BucketReducer([np.zeros_like(p) for p in params], bucket_cap_mb=args.cap,
                                 gradient_as_bucket_view=True)
    grads = reducer.grads  # views into the bucket buffers, used by every way alike
    avg = spmd.ReduceOp.AVG

    def step(mode):
        for g in grads:
            g.fill(0.0)
        outs = _mlp.forward(params, x, acts)
        _, dy = _mlp.mse(outs[-1], target)
        works = []
        if mode == "reducer":
            def hook(i):
                reducer.mark_ready(2 * i + 1)
                reducer.mark_ready(2 * i)
        elif mode == "per gradient":
            def hook(i):
                for k in (2 * i + 1, 2 * i):
                    works.append(spmd.all_reduce(grads[k], op=avg, async_op=True))
        else:
            hook = None
        _mlp.backward(params, outs, dy, grads, acts, on_layer=hook)
        if mode == "reducer":
            reducer.wait()
        elif mode == "per gradient":
            for w in works:
                w.wait()
        elif mode == "after backward":
            spmd.all_reduce_coalesced(grads, op=avg)

    modes = ["compute only", "reducer", "per gradient", "after backward"]
    times = {m: [] for m in modes}
    for r in range(args.steps + 2):
        for m in modes:
            spmd.barrier()
            t0 = time.perf_counter()
            step(m)
            t = np.array([time.perf_counter() - t0])
            spmd.all_reduce(t, op=spmd.ReduceOp.MAX)
            if r >= 2:
                times[m].append(float(t[0]))
    if rank == 0:
        mib = sum(p.nbytes for p in params) / 2**20
        print(f"dp step at {size} ranks: {args.layers} layers of {args.width} float32 "
              f"({mib:.0f} MiB of gradients, {len(params)} arrays), batch {args.batch}/rank, "
              f"{len(reducer.buckets)} buckets of <= {args.cap} MiB; median of {args.steps} steps")
        print(f"| {'':14} | {'step ms':>8} | {'comm ms (over compute)':>22} |")
        print(f"|{'-' * 16}|{'-' * 9}:|{'-' * 23}:|")
        base = statistics.median(times["compute only"])
        for m in modes:
            t = statistics.median(times[m])
            print(f"| {m:14} | {1e3 * t:8.1f} | {1e3 * (t - base):22.1f} |")
    spmd.destroy_process_group()


if __name__ == "__main__":
    main()
