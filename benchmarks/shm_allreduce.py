"""The shared-memory engine against the MPI library, per message size.

Run: mpiexec -n 2 python benchmarks/shm_allreduce.py [--op all_reduce] [--max 64M]
         [--rounds 7] [--algos]

Columns, timed side by side in one run (methods alternate within every round so that
machine noise hits them alike; a round's time is the slowest rank's):

  MPI        mpi4py's blocking call on a private communicator (Comm.Allreduce, ...)
  spmd/mpi   spmd with SPMD_SHM=0: the MPI backend's nonblocking call and Work
  spmd       spmd as configured by default (SPMD_SHM=auto): the engine above its threshold
  shm        the engine at every size (SPMD_SHM=force)
  1-shot, 2-shot  (--algos, all_reduce only) the engine forced to one algorithm

Every figure is the median (or, with --stat min, the minimum) over rounds of the time
per call, in microseconds; the last column is MPI / spmd (above 1: spmd is faster).
Rank 0 prints the table.
"""

import argparse
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

import spmd
from spmd.backends.shm.engine import SHM_ENV

OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce")


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _sizes(largest: int) -> list[int]:
    out, s = [8, 64, 512], 4096
    while s <= largest:
        out.append(s)
        s *= 2 if s < (4 << 20) else 4
    return [s for s in out if s <= largest]


def _group(mode: str, one_shot_max=None):
    """A group of every rank whose engine mode is ``mode`` (its backend is made here)."""
    os.environ[SHM_ENV] = mode
    pg = spmd.new_group(list(range(spmd.get_world_size())))
    spmd.barrier(group=pg)  # makes the group's backend, which reads SPMD_SHM
    engine = pg.engine_for("cpu").shm
    if one_shot_max is not None:
        engine.one_shot_max = one_shot_max
    return pg


def _callers(op: str, nbytes: int, groups: dict, comm: MPI.Intracomm, n: int) -> dict:
    """name -> zero-argument callable running one ``op`` of ``nbytes`` (per-rank input)."""
    items = max(1, nbytes // 4)
    x = np.zeros(items, np.float32)  # sums of zeros stay finite however often they run
    out = {}
    if op == "all_reduce":
        out["MPI"] = lambda: comm.Allreduce(MPI.IN_PLACE, x)
        for name, pg in groups.items():
            out[name] = lambda pg=pg: spmd.all_reduce(x, group=pg)
    elif op == "broadcast":
        out["MPI"] = lambda: comm.Bcast(x, 0)
        for name, pg in groups.items():
            out[name] = lambda pg=pg: spmd.broadcast(x, group_src=0, group=pg)
    elif op == "all_gather_into_tensor":
        y = np.empty(items * n, np.float32)
        out["MPI"] = lambda: comm.Allgather(x, y)
        for name, pg in groups.items():
            out[name] = lambda pg=pg: spmd.all_gather_into_tensor(y, x, group=pg)
    elif op == "reduce_scatter_tensor":
        big = np.zeros(items * n, np.float32)
        out["MPI"] = lambda: comm.Reduce_scatter_block(big, x)
        for name, pg in groups.items():
            out[name] = lambda pg=pg: spmd.reduce_scatter_tensor(x, big, group=pg)
    elif op == "reduce":
        out["MPI"] = lambda: comm.Reduce(MPI.IN_PLACE if comm.Get_rank() == 0 else x,
                                         x if comm.Get_rank() == 0 else None, root=0)
        for name, pg in groups.items():
            out[name] = lambda pg=pg: spmd.reduce(x, group_dst=0, group=pg)
    return out


def _time(fn, iters: int, comm: MPI.Intracomm) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = (time.perf_counter() - t0) / iters
    return comm.allreduce(elapsed, op=MPI.MAX)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", choices=OPS, default="all_reduce")
    ap.add_argument("--max", default="64M", help="largest message per rank (e.g. 64M)")
    ap.add_argument("--sizes", default=None, help="comma-separated sizes instead of the ladder")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--algos", action="store_true", help="add forced one-/two-shot columns")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="figure per size: median (default) or minimum over rounds")
    args = ap.parse_args()

    spmd.init_process_group()
    n, me = spmd.get_world_size(), spmd.get_rank()
    comm = MPI.COMM_WORLD.Dup()
    saved = os.environ.get(SHM_ENV)
    groups = {"spmd/mpi": _group("0"), "spmd": _group("auto"), "shm": _group("force")}
    if args.algos and args.op == "all_reduce":
        groups["1-shot"] = _group("force", one_shot_max=1 << 62)
        groups["2-shot"] = _group("force", one_shot_max=0)
    if saved is None:
        os.environ.pop(SHM_ENV, None)
    else:
        os.environ[SHM_ENV] = saved
    sizes = ([_size(s) for s in args.sizes.split(",")] if args.sizes else _sizes(_size(args.max)))
    names = ["MPI", *groups]
    if me == 0:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(f"{args.op}: {n} ranks, float32, {args.rounds} rounds, load average {load:.2f}; "
              f"{args.stat} us per call")
        print(f"{'bytes':>10} " + " ".join(f"{k:>10}" for k in names) + f" {'MPI/spmd':>9}")
    for nbytes in sizes:
        calls = _callers(args.op, nbytes, groups, comm, n)
        iters = max(1, min(2000, (4 << 20) // max(nbytes, 1)))
        for fn in calls.values():  # warm up: windows, pages, caches
            for _ in range(min(iters, 20)):
                fn()
        times = {k: [] for k in names}
        for _ in range(args.rounds):
            for k in names:
                times[k].append(_time(calls[k], iters, comm))
        stat = statistics.median if args.stat == "median" else min
        med = {k: stat(v) * 1e6 for k, v in times.items()}
        if me == 0:
            row = " ".join(f"{med[k]:10.1f}" for k in names)
            print(f"{nbytes:>10} {row} {med['MPI'] / med['spmd']:9.2f}", flush=True)
    comm.Free()
    spmd.destroy_process_group()


if __name__ == "__main__":
    main()
