"""``spmd bench``: latency and bandwidth of spmd's collectives, side by side with the
raw mpi4py call and torch.distributed (gloo) in the same job, on the same buffers.

::

    mpiexec -n 4 spmd bench                      # the default sweep: 8 B .. 64 MiB
    mpiexec -n 2 spmd bench --quick --json out.json --plot out.png
    mpiexec -n 2 python -m spmd.tools.bench --ops all_reduce --max-bytes 1M
    mpiexec -n 2 spmd bench --torch --min-bytes 16   # torch's calls: spmd, gloo, a no-op, mpi4py
    spmd bench --one-rank --quick                # one process: per-call host cost, no targets

For every op and message size, every implementation is warmed up, then timed call by
call in interleaved rounds (so that noise on a shared machine hits them alike); a
call's time is the slowest rank's.  Rank 0 reports the median and p10/p90 over the
calls, algbw and busbw (nccl-tests' definitions, ``spmd/core/optable.py``) and each time
relative to mpi4py's blocking call, the floor spmd adds its overhead to.  torch's gloo
backend is initialised inside the same mpiexec job over TCP (rank 0's host, a free
port it picks) when torch is installed; ``torch-spmd`` is torch.distributed on spmd's
torch backend (``spmd.torch``), a group made with ``new_group(backend="spmd")`` in
the same job, on the same tensors' sizes.  ``spmd-persistent`` is the same op as an MPI-4
persistent collective started each call (``spmd.api.persistent``).  A fusion section times
many small all-reduces issued one by one against ``all_reduce_coalesced`` and
``coalescing_manager``.

Every rank must run the bench with the same arguments.  It measures communication
between ranks: in a world of one process (``spmd bench`` without a launcher, or
``mpiexec -n 1``) it says how to start it and exits with status 2 before measuring
anything, unless ``--one-rank`` asks for the one-rank figures (each call's host cost,
spmd's beside mpi4py's), which it prints without target lines.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
import time
import warnings
from types import SimpleNamespace

import numpy as np
from mpi4py import MPI

from spmd.core.launch import singleton_problem
from spmd.core.lines import write_lines
from spmd.tools.bench_gpu import run_gpu
from spmd.tools.bench_timing import measure
from spmd.tools.bench_torch import run_torch

__all__ = ["main", "run", "add_arguments", "parse_size", "OPS", "IMPLS"]

OPS = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
       "all_to_all_single", "send_recv", "barrier")
IMPLS = ("spmd", "mpi4py", "spmd-persistent", "torch-gloo", "torch-spmd")
_PERSISTENT_OPS = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor",
                   "reduce_scatter_tensor", "all_to_all_single", "barrier")
_IN_PLACE = MPI.IN_PLACE
_SUM = MPI.SUM

_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1024**2, "MB": 1024**2,
          "MIB": 1024**2, "G": 1024**3, "GB": 1024**3, "GIB": 1024**3}


def parse_size(text: str) -> int:
    """``"8"``, ``"64K"``, ``"1MiB"``, ``"64 MB"`` -> bytes (binary units)."""
    s = str(text).strip().upper().replace(" ", "")
    digits = s.rstrip("KMGIB")
    unit = s[len(digits):]
    try:
        value = float(digits)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 8, 64K, 1M)") from None
    if unit not in _UNITS or value < 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 8, 64K, 1M)")
    return int(value * _UNITS[unit])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", default=None,
                   help=f"comma-separated ops (default: all of {','.join(OPS)}; with "
                        "--torch, of the torch mode's)")
    p.add_argument("--impls", default=None,
                   help="comma-separated implementations (default: all available of "
                        f"{','.join(IMPLS)}; with --torch, of the torch mode's)")
    p.add_argument("--min-bytes", type=parse_size, default=8, help="smallest size (default 8)")
    p.add_argument("--max-bytes", type=parse_size, default=64 * 1024**2,
                   help="largest size (default 64M)")
    p.add_argument("--factor", type=float, default=2.0, help="size multiplier (default 2)")
    p.add_argument("--dtype", default="float32", help="element type (default float32)")
    p.add_argument("--time-per-size", type=float, default=0.3,
                   help="seconds of timed calls per op and size, all implementations "
                        "together (default 0.3)")
    p.add_argument("--min-iters", type=int, default=5, help="fewest timed calls (default 5)")
    p.add_argument("--max-iters", type=int, default=5000, help="most timed calls (default 5000)")
    p.add_argument("--warmup", type=int, default=10, help="most warm-up calls (default 10)")
    p.add_argument("--rounds", type=int, default=10,
                   help="interleaved rounds the timed calls are split into (default 10)")
    p.add_argument("--fusion-arrays", type=int, default=256,
                   help="arrays in the fusion test (default 256; 0 skips it)")
    p.add_argument("--fusion-array-bytes", type=parse_size, default=1024,
                   help="size of each array in the fusion test (default 1K)")
    p.add_argument("--quick", action="store_true",
                   help="a short sweep (8 B .. 64 KiB, few calls) for smoke tests")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the results as JSON to FILE (to stdout instead of the table "
                        "if FILE is - or omitted)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="plot latency and bus bandwidth vs size (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--torch", action="store_true",
                   help="torch.distributed's calls on the spmd backend beside gloo, a "
                        "do-nothing backend and mpi4py (spmd/tools/bench_torch.py)")
    p.add_argument("--one-rank", action="store_true",
                   help="run in a world of one process too: each call's host cost, spmd's "
                        "beside mpi4py's, without target lines (without it, one process "
                        "stops with exit status 2)")
    p.add_argument("--device", choices=["cpu", "cuda", "double"], default="cpu",
                   help="cpu: the host sweep (default); cuda: all_reduce on GPU arrays beside "
                        "torch's NCCL and raw CuPy NCCL, with the GPU targets; double: the "
                        "cuda bench on spmd.testing.device_double (no GPU, no figures)")


class _Config:
    def __init__(self, args, n: int):
        self.ops = [o.strip() for o in (args.ops or ",".join(OPS)).split(",") if o.strip()]
        for o in self.ops:
            if o not in OPS:
                raise SystemExit(f"spmd bench: unknown op {o!r}; expected some of {OPS}")
        if n == 1:   # --one-rank: a ping-pong has no peer
            self.ops = [o for o in self.ops if o != "send_recv"]
            if not self.ops:
                raise SystemExit("spmd bench: send_recv needs two ranks")
        self.impls = [i.strip() for i in (args.impls or ",".join(IMPLS)).split(",")
                      if i.strip()]
        for i in self.impls:
            if i not in IMPLS:
                raise SystemExit(f"spmd bench: unknown implementation {i!r}; expected some "
                                 f"of {IMPLS}")
        self.dtype = np.dtype(args.dtype)
        lo, hi, factor = args.min_bytes, args.max_bytes, args.factor
        self.budget, self.min_iters, self.max_iters = args.time_per_size, args.min_iters, \
            args.max_iters
        self.warmup, self.rounds = args.warmup, args.rounds
        self.fusion_arrays, self.fusion_bytes = args.fusion_arrays, args.fusion_array_bytes
        if args.quick:
            lo, hi, factor = lo, min(hi, 64 * 1024), 8.0
            self.budget, self.min_iters, self.max_iters = 0.02, 3, 200
            self.warmup, self.rounds = 2, 3
            self.fusion_arrays = min(self.fusion_arrays, 64)
        if lo <= 0 or hi < lo or factor <= 1:
            raise SystemExit("spmd bench: need 0 < --min-bytes <= --max-bytes and --factor > 1")
        sizes, s = [], float(lo)
        while s <= hi * (1 + 1e-9):
            sizes.append(int(round(s)))
            s *= factor
        self.sizes = sizes
        self.quick = args.quick
        self.n = n


# -- implementations -------------------------------------------------------------------

class _Torch:
    """torch.distributed with gloo, initialised inside this mpiexec job."""

    def __init__(self, comm, with_spmd: bool = False):
        import torch
        import torch.distributed as dist

        warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
        self.torch, self.dist = torch, dist
        host = socket.gethostname()
        hosts = comm.allgather(host)
        addr = os.environ.get("MASTER_ADDR")
        if addr is None:
            addr = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
        port = None
        if comm.Get_rank() == 0:
            port = os.environ.get("MASTER_PORT")
            if port is None:
                with socket.socket() as s:
                    s.bind(("" if addr != "127.0.0.1" else addr, 0))
                    port = s.getsockname()[1]
        port = comm.bcast(port, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}",
                                rank=comm.Get_rank(), world_size=comm.Get_size())
        self.version = torch.__version__
        self.spmd_group = None
        if with_spmd:
            import spmd.torch  # noqa: F401 - registers the backend

            self.spmd_group = dist.new_group(backend="spmd")

    def spmd_view(self):
        """The same object, its ``dist`` calls bound to the spmd-backed group."""
        import functools

        group, real = self.spmd_group, self.dist

        class _Bound:
            def __getattr__(self, name):
                return functools.partial(getattr(real, name), group=group)

        view = SimpleNamespace(dist=_Bound(), t=self.t)
        return view

    def t(self, a):
        return self.torch.from_numpy(a)  # shares the numpy array's memory

    def close(self):
        self.dist.destroy_process_group()


def _torch_or_none(comm, wanted: bool, with_spmd: bool = False):
    if not wanted:
        return None, "not requested"
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        return None, "torch is not installed"
    return _Torch(comm, with_spmd), None


def _counts(op: str, nbytes: int, itemsize: int, n: int) -> tuple[int, int]:
    """(elements per buffer of the op's largest array, its bytes) for a target size."""
    count = max(1, nbytes // itemsize)
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        count = max(n, count - count % n)
    return count, count * itemsize


def _case(op: str, count: int, dtype, spmd, comm, torch_, persistent_ok: bool):
    """The callables timed for ``op`` on buffers of ``count`` elements, and what must be
    released afterwards."""
    rank, n = comm.Get_rank(), comm.Get_size()
    plans = []
    impls: dict = {}
    td = torch_.dist if torch_ else None
    persistent = spmd.persistent if persistent_ok and op in _PERSISTENT_OPS else None

    def start_wait(plan):
        plans.append(plan)
        start = plan.start
        return lambda: start().wait()

    if op == "all_reduce":
        x = np.zeros(count, dtype)
        impls["spmd"] = lambda: spmd.all_reduce(x)
        impls["mpi4py"] = lambda: comm.Allreduce(_IN_PLACE, x, _SUM)
        if persistent:
            impls["spmd-persistent"] = start_wait(persistent.all_reduce(x))
        if td:
            tx = torch_.t(x)
            impls["torch-gloo"] = lambda: td.all_reduce(tx)
    elif op == "broadcast":
        x = np.zeros(count, dtype)
        impls["spmd"] = lambda: spmd.broadcast(x, 0)
        impls["mpi4py"] = lambda: comm.Bcast(x, 0)
        if persistent:
            impls["spmd-persistent"] = start_wait(persistent.broadcast(x, 0))
        if td:
            tx = torch_.t(x)
            impls["torch-gloo"] = lambda: td.broadcast(tx, 0)
    elif op == "reduce":
        x = np.zeros(count, dtype)
        impls["spmd"] = lambda: spmd.reduce(x, 0)
        if rank == 0:
            impls["mpi4py"] = lambda: comm.Reduce(_IN_PLACE, x, _SUM, 0)
        else:
            impls["mpi4py"] = lambda: comm.Reduce(x, None, _SUM, 0)
        if persistent:
            impls["spmd-persistent"] = start_wait(persistent.reduce(x, 0))
        if td:
            tx = torch_.t(x)
            impls["torch-gloo"] = lambda: td.reduce(tx, 0)
    elif op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        big = np.zeros(count, dtype)
        small = np.zeros(count // n if op != "all_to_all_single" else count, dtype)
        if op == "all_gather_into_tensor":
            impls["spmd"] = lambda: spmd.all_gather_into_tensor(big, small)
            impls["mpi4py"] = lambda: comm.Allgather(small, big)
            make = (lambda: persistent.all_gather_into_tensor(big, small)) if persistent else None
            tfn = td.all_gather_into_tensor if td else None
            targs = (big, small)
        elif op == "reduce_scatter_tensor":
            impls["spmd"] = lambda: spmd.reduce_scatter_tensor(small, big)
            impls["mpi4py"] = lambda: comm.Reduce_scatter_block(big, small, _SUM)
            make = (lambda: persistent.reduce_scatter_tensor(small, big)) if persistent else None
            tfn = td.reduce_scatter_tensor if td else None
            targs = (small, big)
        else:
            impls["spmd"] = lambda: spmd.all_to_all_single(small, big)
            impls["mpi4py"] = lambda: comm.Alltoall(big, small)
            make = (lambda: persistent.all_to_all_single(small, big)) if persistent else None
            tfn = td.all_to_all_single if td else None
            targs = (small, big)
        if make:
            impls["spmd-persistent"] = start_wait(make())
        if tfn:
            ta, tb = torch_.t(targs[0]), torch_.t(targs[1])
            impls["torch-gloo"] = lambda: tfn(ta, tb)
    elif op == "send_recv":
        # Ping-pong between ranks 2k and 2k+1 (a last odd rank sits out); one call is a
        # round trip, reported as half of it: the one-way time.
        x = np.zeros(count, dtype)
        peer = rank ^ 1
        if peer >= n:
            impls.update({k: (lambda: None) for k in ("spmd", "mpi4py")})
            if td:
                impls["torch-gloo"] = lambda: None
        elif rank % 2 == 0:
            def ours():
                spmd.send(x, peer)
                spmd.recv(x, peer)

            def raw():
                comm.Send(x, peer)
                comm.Recv(x, peer)
            impls["spmd"], impls["mpi4py"] = ours, raw
        else:
            def ours():
                spmd.recv(x, peer)
                spmd.send(x, peer)

            def raw():
                comm.Recv(x, peer)
                comm.Send(x, peer)
            impls["spmd"], impls["mpi4py"] = ours, raw
        if td and peer < n:
            tx = torch_.t(x)
            if rank % 2 == 0:
                def tor():
                    td.send(tx, peer)
                    td.recv(tx, peer)
            else:
                def tor():
                    td.recv(tx, peer)
                    td.send(tx, peer)
            impls["torch-gloo"] = tor
    elif op == "barrier":
        impls["spmd"] = spmd.barrier
        impls["mpi4py"] = comm.Barrier
        if persistent:
            impls["spmd-persistent"] = start_wait(persistent.barrier())
        if td:
            impls["torch-gloo"] = td.barrier
    return impls, plans


# -- rows ------------------------------------------------------------------------------

def _row(op, nbytes, count, impl, times, n, halve):
    from spmd.core.optable import bus_factor

    t = times / 2 if halve else times
    med = float(np.median(t))
    algbw = nbytes / med / 1e9 if med > 0 and nbytes else 0.0
    return {"op": op, "bytes": int(nbytes), "count": int(count), "impl": impl,
            "iters": int(t.size), "median_us": med * 1e6,
            "p10_us": float(np.percentile(t, 10)) * 1e6,
            "p90_us": float(np.percentile(t, 90)) * 1e6,
            "mean_us": float(t.mean()) * 1e6, "min_us": float(t.min()) * 1e6,
            "algbw_gbps": algbw,
            "busbw_gbps": algbw * bus_factor(op, n)}


def _fusion(spmd, comm, cfg) -> list[dict]:
    """Many small all-reduces one by one vs fused, on the same arrays."""
    count = max(1, cfg.fusion_bytes // cfg.dtype.itemsize)
    arrays = [np.zeros(count, cfg.dtype) for _ in range(cfg.fusion_arrays)]

    def separate():
        for a in arrays:
            spmd.all_reduce(a)

    def raw_separate():
        for a in arrays:
            comm.Allreduce(_IN_PLACE, a, _SUM)

    def coalesced():
        spmd.all_reduce_coalesced(arrays)

    def manager():
        with spmd.coalescing_manager():
            for a in arrays:
                spmd.all_reduce(a)

    impls = {"spmd all_reduce x N": separate, "mpi4py Allreduce x N": raw_separate,
             "spmd all_reduce_coalesced": coalesced, "spmd coalescing_manager": manager}
    plan = spmd.persistent.all_reduce_coalesced(arrays) if "spmd-persistent" in cfg.impls else None
    if plan is not None:  # the training loop's case: the same arrays fused every step
        impls["spmd persistent all_reduce_coalesced"] = lambda: plan.start().wait()
    small = SimpleNamespace(**vars(cfg))
    small.budget, small.min_iters = max(cfg.budget, 0.05) * 2, max(cfg.min_iters, 5)
    try:
        times = measure(comm, impls, small)
    finally:
        if plan is not None:
            plan.free()
    base = float(np.median(times["spmd all_reduce x N"]))
    rows = []
    for name, t in times.items():
        med = float(np.median(t))
        rows.append({"impl": name, "arrays": len(arrays), "array_bytes": count * cfg.dtype.itemsize,
                     "iters": int(t.size), "median_us": med * 1e6,
                     "p10_us": float(np.percentile(t, 10)) * 1e6,
                     "p90_us": float(np.percentile(t, 90)) * 1e6,
                     "speedup_vs_separate": base / med if med > 0 else 0.0})
    return rows


def _environment(comm, torch_, torch_note, cfg) -> dict:
    import mpi4py

    import spmd
    from spmd.backends.mpi import fastcall
    from spmd.core import wait as _wait

    hosts = comm.allgather(socket.gethostname())
    return {"world_size": comm.Get_size(), "hosts": len(set(hosts)),
            "cores_on_rank0_host": os.cpu_count(), "oversubscribed": _wait.oversubscribed,
            "dtype": cfg.dtype.name, "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
            "mpi_standard": "{}.{}".format(*MPI.Get_version()), "mpi4py": mpi4py.__version__,
            "numpy": np.__version__, "spmd": spmd.__version__, "python": platform.python_version(),
            "torch": torch_.version if torch_ else None, "torch_note": torch_note,
            "persistent_native": spmd.persistent.available(), "quick": cfg.quick,
            "call_path": "compiled" if fastcall.compiled is not None else
            f"Python ({fastcall.reason})",
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def run(args) -> dict | None:
    """Run the sweep (every rank); return the results dict on rank 0, None elsewhere."""
    import spmd

    own_init = not spmd.is_initialized()
    if own_init:
        spmd.init_process_group()
    world = spmd.GroupMember.WORLD
    assert world is not None  # initialised above
    comm = world.comm
    rank, n = comm.Get_rank(), comm.Get_size()
    cfg = _Config(args, n)
    with_spmd = "torch-spmd" in cfg.impls
    torch_, torch_note = _torch_or_none(comm, "torch-gloo" in cfg.impls or with_spmd, with_spmd)
    persistent_ok = "spmd-persistent" in cfg.impls
    progress = _progress(rank == 0 and not args.no_progress,
                         sum(1 if op == "barrier" else len(cfg.sizes) for op in cfg.ops))
    results = []
    try:
        for op in cfg.ops:
            sizes = [0] if op == "barrier" else cfg.sizes
            for size in sizes:
                count, nbytes = _counts(op, size, cfg.dtype.itemsize, n) if size else (0, 0)
                impls, plans = _case(op, count, cfg.dtype, spmd, comm, torch_, persistent_ok)
                if with_spmd and torch_ is not None:  # the torch calls, on the spmd group
                    bound, _ = _case(op, count, cfg.dtype, spmd, comm, torch_.spmd_view(), False)
                    if "torch-gloo" in bound:
                        impls["torch-spmd"] = bound["torch-gloo"]
                impls = {k: v for k, v in impls.items() if k in cfg.impls}
                try:
                    times = measure(comm, impls, cfg)
                finally:
                    for p in plans:
                        p.free()
                for impl, t in times.items():
                    results.append(_row(op, nbytes, count, impl, t, n, op == "send_recv"))
                progress.update(op, nbytes)
        fusion = _fusion(spmd, comm, cfg) if cfg.fusion_arrays > 0 else []
    finally:
        progress.close()
        if torch_ is not None:
            torch_.close()
    env = _environment(comm, torch_, torch_note, cfg)
    if own_init:
        spmd.destroy_process_group()
    if rank != 0:
        return None
    from spmd.tools.bench_report import add_ratios, targets

    add_ratios(results)
    doc = {"format": "spmd-bench", "version": 1, "environment": env, "results": results,
           "fusion": fusion}
    doc["targets"] = targets(doc) if n > 1 else []   # their bounds are about ranks talking
    return doc


class _NoProgress:
    def update(self, op, nbytes):
        pass

    def close(self):
        pass


class _Progress:
    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="spmd bench", unit="size", file=sys.stderr,
                        leave=False, dynamic_ncols=True)

    def update(self, op, nbytes):
        self.bar.set_postfix_str(f"{op} {nbytes} B", refresh=False)
        self.bar.update(1)

    def close(self):
        self.bar.close()


def _progress(on: bool, total: int):
    if not on:
        return _NoProgress()
    try:
        return _Progress(total)
    except ImportError:  # tqdm is an optional extra
        return _NoProgress()


ONE_PROCESS = ("spmd bench measures communication between ranks, and this is a world of one "
               "process.\nStart it with two or more ranks: mpiexec -n 2 spmd bench (under "
               "SLURM: srun -n 2 spmd bench).\nspmd bench --one-rank measures one process "
               "anyway: each call's host cost, with no target lines.")


def bench_command(args) -> int:
    """Entry point of ``spmd bench`` (after argument parsing): exit status 2, with what to
    run instead, in a world of one process without ``--one-rank``."""
    if MPI.COMM_WORLD.Get_size() == 1 and not args.one_rank:
        problem = singleton_problem(   # a launcher's ranks that MPI made worlds of one
            1, library=MPI.Get_library_version().splitlines()[0].strip())
        write_lines(ONE_PROCESS + (f"\nspmd bench: {problem}" if problem else ""),
                    sys.stderr)
        return 2
    if args.device != "cpu":
        return run_gpu(args)
    if args.torch:
        return run_torch(args)
    doc = run(args)
    if doc is None:
        return 0
    from spmd.tools.bench_report import plot, table, write_json

    if args.json is not None:
        write_json(doc, args.json)
    if args.json != "-":
        write_lines(table(doc))
        if doc["environment"]["world_size"] == 1:
            write_lines("one rank (--one-rank): no message leaves the process, so each time is "
                        "the call's host cost; send_recv (no peer) and the targets left out")
    if args.plot:
        try:
            plot(doc, args.plot)
        except ImportError:
            write_lines("spmd bench: --plot needs matplotlib (pip install 'spmd[bench]')",
                        sys.stderr)
            return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="spmd bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return bench_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
