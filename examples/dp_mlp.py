"""Data parallelism with gradient buckets, as torch's DistributedDataParallel does it.

Run: mpiexec -n 4 python examples/dp_mlp.py [--bucket-bytes 2048]

Every rank holds the whole model and trains on its shard of each global batch; the
gradients are averaged across ranks before each step, so the replicas stay identical
and together take the step full-batch training would take.

One all_reduce per parameter would send many tiny messages; one for all gradients after
backward would leave the network idle during backward.  So, as in DDP, parameters are
grouped into buckets of about ``--bucket-bytes`` in reverse order (backward produces the
last layer's gradients first), and a bucket's all_reduce is started with async_op=True
as soon as its last gradient is final, while backward goes on with earlier layers.
The optimizer waits for every bucket.  (How much of the reduction really runs during
backward depends on the MPI library's asynchronous progress.)

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


class GradBuckets:
    """Gradients kept in flat per-bucket buffers and averaged over ``group`` per bucket.

    ``grads[i]`` is a view into a bucket buffer shaped like ``params[i]``, so one
    all_reduce reduces a whole bucket in place with no packing (DDP's
    ``gradient_as_bucket_view``).  Every rank must mark the same parameters ready:
    buckets are launched strictly in bucket order, because the collectives of a group
    are matched by the order they are issued in, not by the buffer they reduce.
    """

    def __init__(self, params, bucket_bytes, group=None):
        self.group = group
        members = [[]]                      # parameter indices per bucket, last layer first
        size = 0
        for i in reversed(range(len(params))):
            if members[-1] and size + params[i].nbytes > bucket_bytes:
                members.append([])
                size = 0
            members[-1].append(i)
            size += params[i].nbytes
        self.grads = [None] * len(params)
        self.bucket_of = [0] * len(params)
        self.buffers = []
        for b, indices in enumerate(members):
            buf = np.zeros(sum(params[i].size for i in indices), dtype=params[indices[0]].dtype)
            offset = 0
            for i in indices:
                self.grads[i] = buf[offset:offset + params[i].size].reshape(params[i].shape)
                self.bucket_of[i] = b
                offset += params[i].size
            self.buffers.append(buf)
        self.counts = [len(indices) for indices in members]
        self.pending = list(self.counts)
        self.works = []

    def zero_grad(self):
        for buf in self.buffers:
            buf.fill(0.0)

    def ready(self, *indices):
        """Mark these parameters' gradients final; start every bucket that is complete."""
        for i in indices:
            self.pending[self.bucket_of[i]] -= 1
        while len(self.works) < len(self.buffers) and self.pending[len(self.works)] == 0:
            buf = self.buffers[len(self.works)]
            self.works.append(dist.all_reduce(buf, op=dist.ReduceOp.AVG, group=self.group,
                                              async_op=True))

    def wait(self):
        """Wait until every bucket is averaged (call before the optimizer step)."""
        if len(self.works) != len(self.buffers):
            raise RuntimeError(f"only {len(self.works)} of {len(self.buffers)} buckets were "
                               "started: some parameter's gradient was never marked ready")
        for work in self.works:
            work.wait()
        self.pending = list(self.counts)
        self.works = []


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-bytes", type=int, default=2048)
    args = parser.parse_args()

    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if BATCH % world:
        raise ValueError(f"the batch of {BATCH} does not split evenly over {world} ranks")

    # Every rank builds the same data and the same initial weights from fixed seeds.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, SIZES[0]))
    target = np.sin(x @ rng.standard_normal((SIZES[0], SIZES[-1])))
    acts = _mlp.tanh_but_last(len(SIZES) - 1)
    params = _mlp.init_params(SIZES, seed=1)
    ref_losses, ref_params = _mlp.train_serial(params, acts, x, target, STEPS, LR)

    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    buckets = GradBuckets(params, args.bucket_bytes)
    losses = np.zeros(STEPS)
    for step in range(STEPS):
        buckets.zero_grad()
        outs = _mlp.forward(params, x[shard], acts)
        losses[step], dy = _mlp.mse(outs[-1], target[shard])
        _mlp.backward(params, outs, dy, buckets.grads, acts,
                      on_layer=lambda i: buckets.ready(2 * i, 2 * i + 1))
        buckets.wait()
        _mlp.sgd(params, buckets.grads, LR)

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
             f"buckets={len(buckets.buffers)} loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
