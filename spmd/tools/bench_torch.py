"""``spmd bench --torch``: torch.distributed's calls on the spmd backend, beside gloo, a
do-nothing backend and raw mpi4py, in one job, on the same tensors' sizes.

::

    mpiexec -n 2 spmd bench --torch --min-bytes 16 --factor 8 --max-bytes 4M
    mpiexec -n 2 spmd bench --torch --quick --json torch.json

Implementations, each on its own group of every rank (the default group is spmd's):

- ``mpi4py``: the raw call on the tensor's memory (``comm.Allreduce`` on ``t.numpy()``
  made once), the floor every torch backend adds its cost to;
- ``torch-spmd``: ``torch.distributed`` on the spmd backend (``spmd.torch``);
- ``torch-gloo``: ``torch.distributed`` on gloo;
- ``torch-null``: ``torch.distributed`` on a backend whose ops return at once, having
  done nothing: what torch's own dispatch into a Python ProcessGroup costs (its Python
  API, its options objects, the call), the part of torch-spmd's time no backend written
  in Python can remove.

Ops: all_reduce, broadcast, all_gather_into_tensor (torch's ``all_gather_single`` where it
has it: the older name warns on every call), reduce_scatter_tensor (likewise
``reduce_scatter_single``), send_recv (a ping-pong between ranks 2k and 2k+1, reported as
half a round trip) and barrier.  Times are the slowest rank's per call, medians of
interleaved rounds (``spmd.tools.bench_timing.measure``); the ratios divide by mpi4py's median.
The target line checks the issue's bound on a 16 B all_reduce (the smallest measured
where 16 B was not): torch-spmd at most ``TARGET`` times mpi4py.

Every rank must run the bench with the same arguments.
"""

from __future__ import annotations

import statistics
import sys
import warnings
from types import SimpleNamespace
from typing import Any

import numpy as np

from spmd.core.lines import write_lines
from spmd.tools.bench_timing import measure
from spmd.tools.comms_log import format_size

__all__ = ["TORCH_OPS", "TORCH_IMPLS", "TARGET", "TARGET_BYTES", "run_torch", "table",
           "target"]

TORCH_OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
             "send_recv", "barrier")
TORCH_IMPLS = ("mpi4py", "torch-spmd", "torch-gloo", "torch-null")
TARGET = 2.0   # torch-spmd / mpi4py time of an all_reduce of TARGET_BYTES, at most
TARGET_BYTES = 16
NULL_BACKEND = "spmd-bench-null"


def _null_backend(dist: Any) -> None:
    """Register ``NULL_BACKEND``: a Python ProcessGroup whose ops do nothing."""
    if NULL_BACKEND in dist.Backend.backend_list:
        return

    class Done(dist.Work):
        def wait(self, timeout=None) -> bool:
            return True

    class NullGroup(dist.ProcessGroup):
        """Every op returns at once: None where torch waits at once, else a done Work
        (what a send or receive must return)."""

        def allreduce(self, tensors, opts=None):
            return None

        def broadcast(self, tensors, opts=None):
            return None

        def all_gather_single(self, output, input, opts=None):
            return None

        def reduce_scatter_single(self, output, input, opts=None):
            return None

        def barrier(self, opts=None):
            return None

        def send(self, tensors, dst, tag=0):
            return Done()

        def recv(self, tensors, src, tag=0):
            return Done()

        def getBackendName(self) -> str:
            return NULL_BACKEND

        # what torch keeps on a group (a Python ProcessGroup keeps it itself)
        def _set_group_name(self, name: str) -> None:
            self._name = name

        def _set_group_desc(self, desc: str) -> None:
            self._desc = desc

        @property
        def group_name(self) -> str:
            return self._name

        @property
        def group_desc(self) -> str:
            return self._desc

        _allgather_base = all_gather_single
        _reduce_scatter_base = reduce_scatter_single

    def create(opts, pg_options):
        return NullGroup(opts.group_rank, opts.group_size)

    dist.Backend.register_backend(NULL_BACKEND, create, extended_api=True, devices=["cpu"])


def _sizes(args) -> list[int]:
    lo, hi, factor = args.min_bytes, args.max_bytes, args.factor
    if args.quick:
        hi, factor = min(hi, 64 * 1024), max(factor, 8.0)
    if lo <= 0 or hi < lo or factor <= 1:
        raise SystemExit("spmd bench: need 0 < --min-bytes <= --max-bytes and --factor > 1")
    out, s = [], float(lo)
    while s <= hi * (1 + 1e-9):
        out.append(int(round(s)))
        s *= factor
    return out


def _timing(args) -> SimpleNamespace:
    """What ``measure`` reads: the time per size and the numbers of calls and rounds."""
    if args.quick:
        return SimpleNamespace(budget=0.02, min_iters=3, max_iters=200, warmup=2, rounds=3)
    return SimpleNamespace(budget=args.time_per_size, min_iters=args.min_iters,
                           max_iters=args.max_iters, warmup=args.warmup, rounds=args.rounds)


def _calls(op: str, nbytes: int, torch: Any, dist: Any, comm: Any, groups: dict) -> dict:
    """{impl: call} for ``op`` on float32 tensors of about ``nbytes`` (the largest one)."""
    from mpi4py import MPI

    rank, n = comm.Get_rank(), comm.Get_size()
    count = max(1, nbytes // 4)
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        count = max(n, count - count % n)
    big, small = torch.zeros(count), torch.zeros(count // n)
    # one numpy view of each tensor, made once: mpi4py's floor has no per-call cost here
    bnp, snp = big.numpy(), small.numpy()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    calls: dict = {}
    if op == "all_reduce":
        calls["mpi4py"] = lambda: comm.Allreduce(MPI.IN_PLACE, bnp, MPI.SUM)
        for impl, g in groups.items():
            calls[impl] = lambda g=g: dist.all_reduce(big, group=g)
    elif op == "broadcast":
        calls["mpi4py"] = lambda: comm.Bcast(bnp, 0)
        for impl, g in groups.items():
            calls[impl] = lambda g=g: dist.broadcast(big, 0, group=g)
    elif op == "all_gather_into_tensor":
        calls["mpi4py"] = lambda: comm.Allgather(snp, bnp)
        for impl, g in groups.items():
            calls[impl] = lambda g=g: gather(big, small, group=g)
    elif op == "reduce_scatter_tensor":
        calls["mpi4py"] = lambda: comm.Reduce_scatter_block(bnp, snp, MPI.SUM)
        for impl, g in groups.items():
            calls[impl] = lambda g=g: scatter(small, big, group=g)
    elif op == "send_recv":
        peer = rank ^ 1
        if peer >= n:   # a last odd rank sits out
            return {impl: (lambda: None) for impl in ("mpi4py", *groups)}
        first = rank % 2 == 0

        def ping(send, recv):
            return (lambda: (send(), recv())) if first else (lambda: (recv(), send()))

        calls["mpi4py"] = ping(lambda: comm.Send(bnp, peer), lambda: comm.Recv(bnp, peer))
        for impl, g in groups.items():
            calls[impl] = ping(lambda g=g: dist.send(big, peer, group=g),
                               lambda g=g: dist.recv(big, peer, group=g))
    elif op == "barrier":
        calls["mpi4py"] = comm.Barrier
        for impl, g in groups.items():
            calls[impl] = lambda g=g: dist.barrier(group=g)
    return calls


def _row(op: str, nbytes: int, times: dict, halve: bool) -> dict:
    med = {k: float(statistics.median(v)) * 1e6 / (2 if halve else 1) for k, v in times.items()}
    base = med.get("mpi4py")
    return {"op": op, "bytes": nbytes, "median_us": med,
            "vs_mpi4py": {k: v / base for k, v in med.items()} if base else {}}


def run_torch(args) -> int:
    """Run the torch sweep on every rank; rank 0 prints the table (and the JSON)."""
    import spmd

    wanted = _chosen(args.impls, TORCH_IMPLS, "implementation")
    ops = _chosen(args.ops, TORCH_OPS, "op")
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        write_lines("spmd bench --torch: torch is not installed", sys.stderr)
        return 1
    import spmd.torch  # noqa: F401 - registers the backend where autoload is off

    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("spmd")
    _null_backend(dist)
    world = spmd.GroupMember.WORLD
    assert world is not None   # the spmd backend initialised spmd
    comm = world.comm
    rank, n = comm.Get_rank(), comm.Get_size()
    if n == 1:   # --one-rank: a ping-pong has no peer
        ops = [op for op in ops if op != "send_recv"]
    backends = {"torch-spmd": "spmd", "torch-gloo": "gloo", "torch-null": NULL_BACKEND}
    groups = {impl: dist.new_group(backend=b) for impl, b in backends.items() if impl in wanted}
    timing = _timing(args)
    rows = []
    try:
        for op in ops:
            for nbytes in ([0] if op == "barrier" else _sizes(args)):
                calls = _calls(op, nbytes, torch, dist, comm, groups)
                calls = {k: v for k, v in calls.items() if k in wanted}
                times = measure(comm, calls, timing)
                rows.append(_row(op, nbytes, times, op == "send_recv"))
    finally:
        for g in groups.values():
            dist.destroy_process_group(g)
        if own:
            dist.destroy_process_group()
    if rank != 0:
        return 0
    doc = {"format": "spmd-bench-torch", "version": 1, "world_size": n,
           "torch": torch.__version__, "results": rows,
           "target": target(rows) if n > 1 else None}   # one rank (--one-rank): no target
    if args.json is not None:
        from spmd.tools.bench_report import write_json

        write_json(doc, args.json)
    if args.json != "-":
        write_lines(table(doc))
    return 0


def _chosen(text: str | None, known: tuple, what: str) -> list[str]:
    """The names of a comma-separated argument (all of ``known`` when not given)."""
    if not text:
        return list(known)
    names = [x.strip() for x in text.split(",") if x.strip()]
    for x in names:
        if x not in known:
            raise SystemExit(f"spmd bench --torch: unknown {what} {x!r}; expected some of "
                             f"{','.join(known)}")
    return names


def target(rows: list[dict]) -> dict | None:
    """The issue's bound: torch-spmd / mpi4py for a 16 B all_reduce (or the smallest
    all_reduce measured, where 16 B was not)."""
    small = [r for r in rows if r["op"] == "all_reduce" and "torch-spmd" in r["vs_mpi4py"]]
    if not small:
        return None
    r = min(small, key=lambda r: (r["bytes"] != TARGET_BYTES, r["bytes"]))
    measured = r["vs_mpi4py"]["torch-spmd"]
    return {"op": "all_reduce", "bytes": r["bytes"], "measured": measured, "bound": TARGET,
            "met": bool(measured <= TARGET)}


def table(doc: dict) -> str:
    impls = [i for i in TORCH_IMPLS if any(i in r["median_us"] for r in doc["results"])]
    ratios = [i for i in impls if i != "mpi4py"]
    lines = [f"spmd bench --torch: {doc['world_size']} rank(s), float32, torch {doc['torch']}",
             "time: per call, slowest rank, median of interleaved rounds; send_recv: one way "
             "(half a round trip); x mpi4py: time / mpi4py's time; torch-null: torch's "
             "dispatch into a Python ProcessGroup whose ops do nothing"]
    head = f"{'size':>10s}" + "".join(f" {i:>12s}" for i in impls) + \
        "".join(f" {i[6:] + ' x':>8s}" for i in ratios)
    for op in dict.fromkeys(r["op"] for r in doc["results"]):
        lines += ["", f"== {op}", head, "-" * len(head)]
        for r in (r for r in doc["results"] if r["op"] == op):
            label = format_size(r["bytes"]) if op != "barrier" else "-"
            lines.append(f"{label:>10s}" +
                         "".join(f" {_us(r['median_us'].get(i)):>12s}" for i in impls) +
                         "".join(f" {_x(r['vs_mpi4py'].get(i)):>8s}" for i in ratios))
    t = doc.get("target")
    if t is not None:
        lines += ["", f"target: all_reduce {format_size(t['bytes'])}, torch-spmd / mpi4py = "
                  f"{t['measured']:.2f} (<= {t['bound']:g}): {'met' if t['met'] else 'NOT MET'}"]
    small = [r for r in doc["results"] if r["op"] == "all_reduce" and "torch-null" in
             r["median_us"]]
    if small:
        r = min(small, key=lambda r: r["bytes"])
        lines.append(f"floor: torch's dispatch of all_reduce into a Python ProcessGroup that "
                     f"does nothing costs {_us(r['median_us']['torch-null'])} per call here")
    return "\n".join(lines)


def _us(us: float | None) -> str:
    if us is None or not np.isfinite(us):
        return "-"
    return f"{us:.2f} us" if us < 1000 else f"{us / 1e3:.3f} ms"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"
