"""Setup time of a DeviceMesh against the same groups made with new_group one at a time.

Run: mpiexec -n 8 python benchmarks/mesh_setup.py [--shape 2 2 2] [--repeats 15]

init_device_mesh builds every group of a dimension with one Comm.Split (so its cost
follows the number of dimensions); the other way is what torch does without a bound
device: every rank calls new_group once per group of every dimension, in the same
order (members create it, non-members return at once).  Both run in alternating rounds
so machine noise hits both alike; the slowest rank's time counts, rank 0 prints medians.
"""

import argparse
import itertools
import math
import statistics
import time

import numpy as np
from mpi4py import MPI

import spmd


def group_lists(shape):
    """For every dimension, every group's ranks (as torch's mesh enumerates them)."""
    full = np.arange(math.prod(shape)).reshape(shape)
    return [np.moveaxis(full, d, -1).reshape(-1, shape[d]).tolist() for d in range(len(shape))]


def with_mesh(shape, names):
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    return [g for g in mesh.get_all_groups() if g is not spmd.GroupMember.WORLD]


def one_at_a_time(lists):
    me = spmd.get_rank()
    made = []
    for dim in lists:
        for ranks in dim:
            pg = spmd.new_group(ranks)
            if me in ranks and pg is not spmd.GroupMember.WORLD:
                made.append(pg)
    return made


def timed(fn, *args):
    comm = spmd.GroupMember.WORLD.comm
    comm.Barrier()
    t0 = time.perf_counter()
    made = fn(*args)
    elapsed = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    for pg in made:
        spmd.destroy_process_group(pg)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs="+", default=[2, 2, 2])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    spmd.init_process_group()
    shape = tuple(args.shape)
    n = spmd.get_world_size()
    if math.prod(shape) != n:
        raise SystemExit(f"mesh_setup: shape {shape} needs {math.prod(shape)} ranks, got {n}")
    names = tuple(f"d{i}" for i in range(len(shape)))
    lists = group_lists(shape)
    ways = {"init_device_mesh": (with_mesh, shape, names),
            "new_group x groups": (one_at_a_time, lists)}
    times = {k: [] for k in ways}
    for _ in range(2):  # warm-up: first communicators cost more
        for fn, *a in ways.values():
            timed(fn, *a)
    for _, (name, (fn, *a)) in itertools.product(range(args.repeats), ways.items()):
        times[name].append(timed(fn, *a))
    if spmd.get_rank() == 0:
        groups = sum(len(d) for d in lists)
        print(f"mesh setup, shape {shape}, {n} ranks: {len(shape)} dimensions, {groups} groups; "
              f"median of {args.repeats} (slowest rank)")
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in med.items():
            print(f"  {k:20s} {v * 1e3:8.3f} ms  (min {min(times[k]) * 1e3:.3f}, "
                  f"max {max(times[k]) * 1e3:.3f})")
        print(f"  ratio new_group/mesh: {med['new_group x groups'] / med['init_device_mesh']:.2f}")
    spmd.destroy_process_group()


if __name__ == "__main__":
    main()
