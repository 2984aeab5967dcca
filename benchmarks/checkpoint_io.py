"""Checkpoint save/load throughput: spmd.checkpoint vs one np.save file per rank vs torch DCP.

Run: mpiexec -n 4 python benchmarks/checkpoint_io.py [--mib 1024] [--repeat 3] [--dir DIR]
     [--no-sync]

The state is ``--mib`` MiB of float32 in total, four arrays whose rows are split over
the ranks (each rank holds 1/N of every array).  Each implementation saves it into a
fresh directory and loads it back into preallocated arrays, ``--repeat`` times in
interleaved rounds (the order rotated each round); rank 0 prints the median time (the slowest rank's) and GiB/s.

- ``spmd``: ``checkpoint.save``/``load``: one .npy per global array, MPI-IO, synced,
  renamed into place.
- ``np.save/rank``: every rank ``np.save``s its blocks into its own files and fsyncs
  them (files no other world size can read without custom code).
- ``torch DCP``: ``torch.distributed.checkpoint.save``/``load`` of DTensors sharded on a
  1-D CPU mesh (gloo), default FileSystemWriter (one file per rank, synced, metadata).

All three flush to storage before they return (``--no-sync``: none does, so a save
times the copy into the page cache, which is what a save to a disk much faster than
this one comes down to); the page cache is not dropped, so loads may come from memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time

import numpy as np

import spmd
from spmd import checkpoint as ckpt

N_ARRAYS = 4


def rows(n, rank, size):
    base, extra = divmod(n, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def make_state(mib, rank, size):
    """This rank's blocks of N_ARRAYS global (rows x 1024) float32 arrays."""
    n_rows = mib * (1 << 20) // (4 * 1024 * N_ARRAYS)
    lo, hi = rows(n_rows, rank, size)
    rng = np.random.default_rng(rank)
    blocks = {f"w{i}": rng.standard_normal((hi - lo, 1024), dtype=np.float32)
              for i in range(N_ARRAYS)}
    return blocks, (n_rows, 1024), lo


def timed(fn, *args):
    spmd.barrier()
    t0 = time.perf_counter()
    fn(*args)
    spmd.barrier()
    t = np.array([time.perf_counter() - t0])
    spmd.all_reduce(t, op=spmd.ReduceOp.MAX)
    return float(t[0])


class Spmd:
    name = "spmd"

    def __init__(self, blocks, gshape, lo, sync):
        self.sync = sync
        self.state = {k: ckpt.Shard(v, gshape, (lo, 0)) for k, v in blocks.items()}
        self.target = {k: ckpt.Shard(np.empty_like(v), gshape, (lo, 0))
                       for k, v in blocks.items()}

    def save(self, path):
        ckpt.save(self.state, path, sync=self.sync)

    def load(self, path):
        ckpt.load(self.target, path)


class PerRank:
    name = "np.save/rank"

    def __init__(self, blocks, gshape, lo, sync):
        self.blocks = blocks
        self.sync = sync
        self.rank = spmd.get_rank()

    def save(self, path):
        if self.rank == 0:
            os.mkdir(path)
        spmd.barrier()
        for k, v in self.blocks.items():
            with open(os.path.join(path, f"{k}.rank{self.rank}.npy"), "wb") as f:
                np.save(f, v)
                if self.sync:
                    f.flush()
                    os.fsync(f.fileno())

    def load(self, path):
        for k, v in self.blocks.items():
            v[...] = np.load(os.path.join(path, f"{k}.rank{self.rank}.npy"))


class TorchDCP:
    name = "torch DCP"

    def __init__(self, blocks, gshape, lo, sync):
        import torch
        from torch.distributed.tensor import DTensor, Shard, init_device_mesh

        self.sync = sync
        mesh = init_device_mesh("cpu", (spmd.get_world_size(),))
        self.state = {k: DTensor.from_local(torch.from_numpy(v), mesh, [Shard(0)],
                                            run_check=False, shape=torch.Size(gshape),
                                            stride=(gshape[1], 1))
                      for k, v in blocks.items()}
        self.target = {k: DTensor.from_local(torch.empty_like(torch.from_numpy(v)), mesh,
                                             [Shard(0)], run_check=False,
                                             shape=torch.Size(gshape), stride=(gshape[1], 1))
                       for k, v in blocks.items()}

    def save(self, path):
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state, storage_writer=dcp.FileSystemWriter(path, sync_files=self.sync))

    def load(self, path):
        import torch.distributed.checkpoint as dcp

        dcp.load(self.target, checkpoint_id=path)


def init_torch():
    """torch.distributed over gloo inside this MPI job; False without torch."""
    try:
        import torch.distributed as tdist
    except ImportError:
        return False
    box = [None]
    if spmd.get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            box[0] = s.getsockname()[1]
    spmd.broadcast_object_list(box, src=0)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{box[0]}",
                             rank=spmd.get_rank(), world_size=spmd.get_world_size())
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="total state in MiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--no-sync", action="store_true",
                        help="no implementation flushes its files to storage")
    parser.add_argument("--verbose", action="store_true", help="print every round's times")
    args = parser.parse_args()

    spmd.init_process_group()
    rank, size = spmd.get_rank(), spmd.get_world_size()
    box = [tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir) if rank == 0 else None]
    spmd.broadcast_object_list(box, src=0)
    root = box[0]
    blocks, gshape, lo = make_state(args.mib, rank, size)
    sync = not args.no_sync
    impls = [Spmd(blocks, gshape, lo, sync), PerRank(blocks, gshape, lo, sync)]
    if not args.no_torch and init_torch():
        impls.append(TorchDCP(blocks, gshape, lo, sync))
    times = {(impl.name, what): [] for impl in impls for what in ("save", "load")}
    for r in range(args.repeat):
        # Rotated each round: whoever writes after another's big write may be throttled
        # by the kernel's write-back of that data, so nobody always goes first.
        for impl in impls[r % len(impls):] + impls[:r % len(impls)]:
            path = os.path.join(root, f"{impl.name.replace('/', '_').replace(' ', '_')}-{r}")
            times[impl.name, "save"].append(timed(impl.save, path))
            times[impl.name, "load"].append(timed(impl.load, path))
            if rank == 0 and args.verbose:
                print(f"round {r} {impl.name}: save {times[impl.name, 'save'][-1]:.2f} s, "
                      f"load {times[impl.name, 'load'][-1]:.2f} s", flush=True)
            spmd.barrier()
            if rank == 0:
                shutil.rmtree(path)
    gib = 4 * gshape[0] * gshape[1] * N_ARRAYS / 2**30
    if rank == 0:
        print(f"checkpoint of {gib:.2f} GiB float32 ({N_ARRAYS} arrays of {gshape}) at {size} "
              f"ranks, {'synced' if sync else 'not synced'}, median of {args.repeat}, "
              "slowest rank")
        print(f"| {'':14} | {'save s':>7} | {'save GiB/s':>10} | {'load s':>7} | "
              f"{'load GiB/s':>10} |")
        print(f"|{'-' * 16}|{'-' * 9}:|{'-' * 12}:|{'-' * 9}:|{'-' * 12}:|")
        for impl in impls:
            s = statistics.median(times[impl.name, "save"])
            ld = statistics.median(times[impl.name, "load"])
            print(f"| {impl.name:14} | {s:7.2f} | {gib / s:10.2f} | {ld:7.2f} | {gib / ld:10.2f} |")
        # Per-round ratios: the disk's speed drifts between rounds, less within one.
        for impl in impls[1:]:
            for what in ("save", "load"):
                ratio = statistics.median(a / b for a, b in zip(times["spmd", what],
                                                                times[impl.name, what]))
                print(f"{what}: spmd time / {impl.name} time, median of the rounds' ratios: "
                      f"{ratio:.2f}")
        shutil.rmtree(root, ignore_errors=True)
    spmd.destroy_process_group()


if __name__ == "__main__":
    main()
