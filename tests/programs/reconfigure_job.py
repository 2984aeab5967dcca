"""torch 2.14's reconfigure on the spmd backend, one way per run.

    mpiexec -n N python tests/programs/reconfigure_job.py WAY [STORE_DIR]

WAY:
  reorder  every rank passes the handles reversed: the ranks come out reversed;
  set      the handles as a set: the ranks stay;
  shrink   the last rank leaves (a planned removal): the others reconfigure on theirs;
  spawn    spmd.torch.spawn_peers(1) starts a process that joins: N + 1 ranks;
  kill     (ULFM) the last rank is SIGKILLed inside an all_reduce; the survivors catch
           torch's DistBackendError, reconfigure on their handles, spawn_peers(1) and
           reconfigure again: N ranks, the new process at the lost rank;
  port     the job joins with one more process started by its own mpiexec
           (``reconfigure_job.py newcomer STORE_DIR``), found through its handle's MPI
           port; both publish their handles in a FileStore in STORE_DIR.

Every process of the final group prints ``RESULT {json}``: its rank and size (torch's
and, through the C++ group DDP reads, its reducer's view), the all_reduce of the ranks,
how it came (old rank, new process), and its handle's fields.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import spmd
import spmd.torch

WAY = sys.argv[1]
faulthandler.dump_traceback_later(100, exit=True)


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def store() -> dist.Store:
    """Where the processes publish handles: torch's default store, or, for the port
    way (two jobs, two rendezvous), a FileStore both reach."""
    if WAY in ("port", "newcomer"):
        return dist.FileStore(os.path.join(sys.argv[2], "handles"), -1)
    return dist.distributed_c10d._get_default_store()


def exchange(key: str, ranks: list[int]) -> list[str]:
    """Publish this process's handle under ``key`` and read those of ``ranks``."""
    s = store()
    s.set(f"{key}/{dist.get_rank()}", dist.distributed_c10d._get_reconfigure_handle())
    return [s.get(f"{key}/{r}").decode() for r in ranks]


def reconfigure(uuid: int, handles) -> float:
    t0 = time.monotonic()
    dist.distributed_c10d._reconfigure(uuid=uuid, handles=handles).wait()
    return time.monotonic() - t0


def ddp_size() -> int:
    """The group size DDP's C++ reducer uses: it averages the gradient by it."""
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(torch.ones(1, 1)).sum().backward()   # every rank's own gradient is 1
    return round(dist.get_world_size() / float(model.weight.grad))   # size / (size / it)


def report(**extra) -> None:
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    h = json.loads(dist.distributed_c10d._get_reconfigure_handle()[len("spmd:"):])
    say("RESULT " + json.dumps({
        "rank": dist.get_rank(), "size": dist.get_world_size(),
        "spmd_size": spmd.get_world_size(), "ranks_sum": float(total),
        "ddp_size": ddp_size(), "handle": h, **extra}))


def main() -> None:
    if WAY == "newcomer":   # a process started by its own mpiexec, to join the job
        dist.init_process_group("spmd", enable_reconfigure=True)
        s = store()
        s.set("newcomer", dist.distributed_c10d._get_reconfigure_handle())
        plan = json.loads(s.get("plan").decode())
        seconds = reconfigure(plan["uuid"], plan["handles"])
        report(was="newcomer", seconds=round(seconds, 3))
        dist.destroy_process_group()
        return
    dist.init_process_group("spmd", timeout=timedelta(seconds=5), enable_reconfigure=True)
    if spmd.is_replacement():   # started by spawn_peers: the plan is in the store
        mine = dist.distributed_c10d._get_reconfigure_handle()
        plan = json.loads(store().get(f"plan/{mine}").decode())
        seconds = reconfigure(plan["uuid"], plan["handles"])
        report(was="spawned", seconds=round(seconds, 3))
        dist.destroy_process_group()
        return
    me, n = dist.get_rank(), dist.get_world_size()
    assert dist.distributed_c10d._supports_reconfigure()
    handles = exchange("h0", list(range(n)))
    info: dict = {"was": me}
    if WAY == "reorder":
        info["seconds"] = reconfigure(1, handles[::-1])
    elif WAY == "set":
        info["seconds"] = reconfigure(1, set(handles))
    elif WAY == "shrink":
        if me == n - 1:
            return   # leaves: not among the handles, it takes no part
        info["seconds"] = reconfigure(1, handles[:-1])
    elif WAY == "spawn":
        new = spmd.torch.spawn_peers(1)
        full = handles + new
        if me == 0:
            store().set(f"plan/{new[0]}", json.dumps({"uuid": 1, "handles": full}))
        info["seconds"] = reconfigure(1, full)
    elif WAY == "kill":
        t = torch.ones(1)
        if me == n - 1:
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            dist.all_reduce(t)
            raise SystemExit("all_reduce completed without the killed rank")
        except dist.DistBackendError as err:   # torch's type, spmd's ProcessFailedError
            info["error"] = [type(err).__name__, isinstance(err, spmd.ProcessFailedError),
                             list(getattr(err, "failed_ranks", []))]
        failed = spmd.get_failed_ranks()
        survivors = [r for r in range(n) if r not in failed]
        info["shrink_s"] = reconfigure(1, [handles[r] for r in survivors])
        info["shrunk_size"] = dist.get_world_size()
        handles = exchange("h1", list(range(dist.get_world_size())))
        t0 = time.monotonic()
        new = spmd.torch.spawn_peers(len(failed))
        info["spawn_s"] = time.monotonic() - t0
        full: list[str] = []
        old = iter(handles)
        fresh = iter(new)
        for r in range(n):   # the new processes take the lost ranks
            full.append(next(fresh) if r in failed else next(old))
        if dist.get_rank() == 0:
            for h in new:
                store().set(f"plan/{h}", json.dumps({"uuid": 2, "handles": full}))
        info["grow_s"] = reconfigure(2, full)
    elif WAY == "port":
        s = store()
        newcomer = s.get("newcomer").decode()   # waits for the other job's process
        full = handles + [newcomer]
        if me == 0:
            s.set("plan", json.dumps({"uuid": 1, "handles": full}))
        info["seconds"] = reconfigure(1, full)
    else:
        raise SystemExit(f"unknown way {WAY!r}")
    info = {k: round(v, 3) if isinstance(v, float) else v for k, v in info.items()}
    report(**info)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
