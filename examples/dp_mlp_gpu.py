"""Data parallelism on GPUs: dp_mlp's bucketed gradient averaging, with cupy arrays.

Run: mpiexec -n 2 python examples/dp_mlp_gpu.py [--backend nccl|mpi] [--bucket-bytes 2048]
     srun python examples/dp_mlp_gpu.py          (one rank per GPU: slurm/gpu.sbatch)

Each rank uses the GPU of its node-local rank (modulo the GPUs it sees) and passes it to
``init_process_group(device_id=...)``, which makes it CuPy's current device.  Weights,
activations and gradients live on the GPU; the gradients sit in flat per-bucket
buffers, and each bucket's average over the ranks starts (async_op=True) as soon as
backward has produced its last gradient, as torch's DistributedDataParallel does.  With
NCCL, ``work.wait()`` orders the compute stream after the reduction without blocking
the host.  NCCL needs one GPU per rank: with several ranks on one GPU use
``--backend mpi`` (host staging, or GPU-aware MPI).

Check: the losses and the final parameters equal full-batch training with numpy on one
process, and every rank ends with bit-identical parameters.  Without CuPy or a GPU the
program says so and exits with status 2.
"""

import argparse
import sys

import _mlp
import numpy as np

import spmd as dist

SIZES = (8, 32, 32, 4)
BATCH = 48
STEPS, LR = 20, 0.1


def forward(cp, params, x, acts):
    outs = [x]
    for i, act in enumerate(acts):
        y = outs[-1] @ params[2 * i] + params[2 * i + 1]
        outs.append(cp.tanh(y) if act else y)
    return outs


def backward(params, outs, dy, grads, acts, on_layer):
    """Gradients into ``grads`` (views of bucket buffers), last layer first."""
    for i in reversed(range(len(acts))):
        y = outs[i + 1]
        da = dy * (1.0 - y * y) if acts[i] else dy
        grads[2 * i] += outs[i].T @ da
        grads[2 * i + 1] += da.sum(axis=0)
        dy = da @ params[2 * i].T
        on_layer(i)


class GpuBuckets:
    """Flat device buffers of about ``bucket_bytes``, last layer first; one async AVG
    all_reduce per bucket, started when its last gradient is final."""

    def __init__(self, cp, params, bucket_bytes):
        members = [[]]
        size = 0
        for i in reversed(range(len(params))):
            if members[-1] and size + params[i].nbytes > bucket_bytes:
                members.append([])
                size = 0
            members[-1].append(i)
            size += params[i].nbytes
        self.grads, self.bucket_of, self.buffers = [None] * len(params), [0] * len(params), []
        for b, indices in enumerate(members):
            buf = cp.zeros(sum(params[i].size for i in indices), params[0].dtype)
            offset = 0
            for i in indices:
                self.grads[i] = buf[offset:offset + params[i].size].reshape(params[i].shape)
                self.bucket_of[i] = b
                offset += params[i].size
            self.buffers.append(buf)
        self.counts = [len(m) for m in members]
        self.pending, self.works = list(self.counts), []

    def ready(self, *indices):
        for i in indices:
            self.pending[self.bucket_of[i]] -= 1
        while len(self.works) < len(self.buffers) and self.pending[len(self.works)] == 0:
            self.works.append(dist.all_reduce(self.buffers[len(self.works)],
                                              op=dist.ReduceOp.AVG, async_op=True))

    def wait(self):
        for work in self.works:
            work.wait()  # NCCL: the current stream waits; MPI: the host waits
        self.pending, self.works = list(self.counts), []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["default", "nccl", "mpi"], default="default")
    parser.add_argument("--bucket-bytes", type=int, default=2048)
    args = parser.parse_args()
    try:
        import cupy as cp

        devices = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no CuPy, no driver, no device
        print(f"dp_mlp_gpu: needs CuPy and a CUDA GPU ({type(exc).__name__}: {exc}); "
              "pip install 'spmd[cuda12]' or 'spmd[cuda13]'", file=sys.stderr)
        return 2
    device = dist.get_node_local_rank(fallback_rank=0) % devices
    backend = None if args.backend == "default" else f"cpu:mpi,cuda:{args.backend}"
    dist.init_process_group(backend=backend, device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if BATCH % world:
        raise ValueError(f"the batch of {BATCH} does not split evenly over {world} ranks")

    x, target, acts, host_params, ref_losses, ref_params = _mlp.regression_problem(
        SIZES, BATCH, STEPS, LR)

    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    xs, ts = cp.asarray(x[shard]), cp.asarray(target[shard])
    params = [cp.asarray(p) for p in host_params]  # on the device init selected
    buckets = GpuBuckets(cp, params, args.bucket_bytes)
    losses = cp.zeros(STEPS)
    for step in range(STEPS):
        for buf in buckets.buffers:
            buf.fill(0.0)
        outs = forward(cp, params, xs, acts)
        diff = outs[-1] - ts
        losses[step] = cp.mean(diff * diff)
        backward(params, outs, (2.0 / diff.size) * diff, buckets.grads, acts,
                 on_layer=lambda i: buckets.ready(2 * i, 2 * i + 1))
        buckets.wait()
        for p, g in zip(params, buckets.grads):
            p -= LR * g

    dist.all_reduce(losses, op=dist.ReduceOp.AVG)
    mine = cp.concatenate([p.ravel() for p in params])
    rank0 = mine.copy()
    dist.broadcast(rank0, src=0)
    ref = np.concatenate([p.ravel() for p in ref_params])
    err = np.array([np.abs(losses.get() - ref_losses).max(), np.abs(mine.get() - ref).max(),
                    float(cp.abs(mine - rank0).max())])
    dist.all_reduce(err, op=dist.ReduceOp.MAX)  # every rank judges the same numbers
    if not (err[0] < 1e-10 and err[1] < 1e-9 and err[2] == 0.0):
        raise AssertionError(f"rank {rank}/{world} dp_mlp_gpu: loss err {err[0]:.3g}, param "
                             f"err {err[1]:.3g}, spread across ranks {err[2]:.3g}")
    backend_name = type(dist.GroupMember.WORLD.engine_for("cuda")).__name__
    print(f"rank {rank}/{world} dp_mlp_gpu OK on cuda:{device} ({backend_name}) "
          f"max_err={err[:2].max():.2e} loss {float(losses[0]):.4f} -> {float(losses[-1]):.4f}",
          flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
