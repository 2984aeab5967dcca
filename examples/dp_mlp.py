"""Data parallelism with gradient buckets, as torch's DistributedDataParallel does it.

Run: mpiexec -n 4 python examples/dp_mlp.py [--bucket-bytes 2048]

Every rank holds the whole model and trains on its shard of each global batch; the
gradients are averaged across ranks before each step, so the replicas stay identical
and together take the step full-batch training would take.

One all_reduce per parameter would send many tiny messages; one for all gradients after
backward would leave the network idle during backward.  So, as in DDP,
``spmd.BucketReducer`` groups the gradients into buckets of about ``--bucket-bytes`` in
reverse order (backward produces the last layer's gradients first), and starts a
bucket's all_reduce as soon as its last gradient is marked ready, while backward goes
on with earlier layers.  The optimizer waits for every bucket.

Check: the loss curve over STEPS steps and the final parameters equal full-batch
training on one process, and every rank ends with bit-identical parameters.
"""

import argparse

import _mlp
import numpy as np

import spmd as dist

SIZES = (8, 32, 32, 4)        # layer widths: input, hidden, hidden, output
BATCH = 48                    # global batch: divisible by 1, 2, 3, 4, 6, 8, ...
STEPS, LR = 20, 0.1


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-bytes", type=int, default=2048)
    args = parser.parse_args()

    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if BATCH % world:
        raise ValueError(f"the batch of {BATCH} does not split evenly over {world} ranks")

    # Every rank builds the same data and the same initial weights from fixed seeds.
    x, target, acts, params, ref_losses, ref_params = _mlp.regression_problem(
        SIZES, BATCH, STEPS, LR)

    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    cap_mb = args.bucket_bytes / (1 << 20)
    # As DDP's gradient_as_bucket_view: the gradients are views into the bucket buffers.
    reducer = dist.BucketReducer([np.zeros_like(p) for p in params], bucket_cap_mb=cap_mb,
                                 first_bucket_cap_mb=cap_mb, op=dist.ReduceOp.AVG,
                                 gradient_as_bucket_view=True)
    grads = reducer.grads

    def layer_done(i):
        reducer.mark_ready(2 * i + 1)
        reducer.mark_ready(2 * i)

    losses = np.zeros(STEPS)
    for step in range(STEPS):
        for g in grads:
            g.fill(0.0)
        outs = _mlp.forward(params, x[shard], acts)
        losses[step], dy = _mlp.mse(outs[-1], target[shard])
        _mlp.backward(params, outs, dy, grads, acts, on_layer=layer_done)
        reducer.wait()
        _mlp.sgd(params, grads, LR)

    # Each rank's loss is its shard's mean; equal shards average to the full batch's.
    dist.all_reduce(losses, op=dist.ReduceOp.AVG)
    mine = np.concatenate([p.ravel() for p in params])
    ref = np.concatenate([p.ravel() for p in ref_params])
    rank0 = mine.copy()
    dist.broadcast(rank0, src=0)
    # Every rank judges the same numbers, so all pass or all raise together.
    err = np.array([np.abs(losses - ref_losses).max(), np.abs(mine - ref).max(),
                    np.abs(mine - rank0).max()])
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    ok = (np.allclose(losses, ref_losses, rtol=1e-12, atol=0)
          and np.allclose(mine, ref, rtol=1e-10, atol=1e-12))
    ok = np.array([ok], dtype=bool)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok[0] or err[2] != 0.0:
        raise AssertionError(f"rank {rank}/{world} dp_mlp: loss err {err[0]:.3g}, "
                             f"param err {err[1]:.3g}, spread across ranks {err[2]:.3g}")
    _mlp.say(f"rank {rank}/{world} dp_mlp OK max_err={err[:2].max():.2e} "
             f"buckets={len(reducer.buckets)} loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
