"""Save or load a checkpoint of known arrays at this job's size and in a given layout.

Usage: mpiexec -n N python tests/programs/ckpt_job.py save|load|crash|fill PATH [LAYOUT|STAGE|MIB]

The global arrays are functions of their indices, so every job knows the values
whatever its size: ``w`` (13 x 11 float32), ``e`` (9 x 4 x 5 int64), ``b`` (replicated),
and the value ``step``.  Layouts: ``rows`` (w and e split along dim 0), ``cols`` (along
dim 1), ``blocks`` (w in 2-D blocks from ``Shard.from_mesh`` where the size allows).
``crash STAGE`` kills one rank with SIGKILL at that stage of save: rank 1 (0 alone)
after its arrays are written ("written"), rank 0, which renames, just before the
rename ("renaming").  ``save`` and ``crash`` replace a checkpoint already at PATH.
``fill MIB`` saves two float32 arrays of MIB MiB each (rows split), expects a full disk
to refuse the save on every rank, then saves one of them to ``PATH-after``, which fits
only if the refused save left nothing behind.
Every rank prints ``rank R/N ckpt_job OK`` after checking what it read.
"""

import os
import signal
import sys

import numpy as np

import spmd
from spmd import checkpoint as ckpt
from spmd.checkpoint import save_load


def global_arrays():
    w = (np.arange(13 * 11, dtype=np.float32).reshape(13, 11) * 0.5 - 7).astype(np.float32)
    e = np.arange(9 * 4 * 5, dtype=np.int64).reshape(9, 4, 5) * 3 - 100
    b = np.linspace(-1, 1, 6)
    return {"w": w, "e": e, "b": b}


def split(n, rank, size):
    base, extra = divmod(n, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def shard(g, dim, rank, size, fill=True):
    lo, hi = split(g.shape[dim], rank, size)
    sel = [slice(None)] * g.ndim
    sel[dim] = slice(lo, hi)
    offset = [0] * g.ndim
    offset[dim] = lo
    data = g[tuple(sel)].copy() if fill else np.zeros_like(g[tuple(sel)])
    return ckpt.Shard(data, g.shape, offset)


def layout(kind, fill):
    rank, size = spmd.get_rank(), spmd.get_world_size()
    g = global_arrays()
    if kind == "blocks" and size % 2 == 0:
        mesh = spmd.init_device_mesh("cpu", (size // 2, 2), mesh_dim_names=("r", "c"))
        r0, r1 = split(13, mesh.get_local_rank("r"), size // 2)
        c0, c1 = split(11, mesh.get_local_rank("c"), 2)
        data = g["w"][r0:r1, c0:c1].copy() if fill else np.zeros((r1 - r0, c1 - c0), np.float32)
        w = ckpt.Shard.from_mesh(data, mesh, {0: "r", 1: "c"})
    else:
        w = shard(g["w"], 1 if kind in ("cols", "blocks") else 0, rank, size, fill)
    e = shard(g["e"], 1 if kind == "cols" else 0, rank, size, fill)
    return {"w": w, "e": e, "b": g["b"] if fill else None, "step": 1200 if fill else None}


def main():
    mode, path = sys.argv[1], sys.argv[2]
    arg = sys.argv[3] if len(sys.argv) > 3 else "rows"
    spmd.init_process_group()
    rank, size = spmd.get_rank(), spmd.get_world_size()
    if mode == "save":
        ckpt.save(layout(arg, True), path, overwrite=os.path.exists(path))
    elif mode == "crash":
        victim = 1 if size > 1 and arg == "written" else 0

        def die(stage):
            if stage == arg and rank == victim:
                os.kill(os.getpid(), signal.SIGKILL)

        save_load._fault_hook = die
        ckpt.save(layout("rows", True), path, overwrite=os.path.exists(path))
        raise SystemExit("the save should not have finished")
    elif mode == "fill":
        rows = int(arg) * (1 << 20) // (4 * 256)
        lo, hi = split(rows, rank, size)
        block = ckpt.Shard(np.full((hi - lo, 256), rank, np.float32), (rows, 256), (lo, 0))
        try:
            ckpt.save({"a": block, "z": block}, path)
        except OSError as exc:
            refusal = f"rank {rank}/{size} refused: {exc}"
        else:
            raise SystemExit("the save should not have fit")
        # Rank 0 prints every rank's message: lines from several ranks on one stream can
        # interleave inside a line.
        refusals: list = [None] * size
        spmd.all_gather_object(refusals, refusal)
        if rank == 0:
            print("\n".join(refusals), flush=True)
        ckpt.save({"a": block}, path + "-after")
    else:
        target = layout(arg, False)
        ckpt.load(target, path)
        g = global_arrays()
        for name in ("w", "e"):
            s = target[name]
            sel = tuple(slice(o, o + n) for o, n in zip(s.offset, s.shape))
            if not np.array_equal(s.data, g[name][sel]):
                raise AssertionError(f"rank {rank}: {name} block at {s.offset} differs")
        if not np.array_equal(target["b"], g["b"]) or target["step"] != 1200:
            raise AssertionError(f"rank {rank}: b or step differs")
    print(f"rank {rank}/{size} ckpt_job OK", flush=True)
    spmd.destroy_process_group()


if __name__ == "__main__":
    main()
