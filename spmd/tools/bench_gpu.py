"""``spmd bench --device cuda``: all_reduce on GPU arrays beside torch's NCCL and raw
CuPy NCCL, in one job, with the targets checked.

Per implementation, medians of interleaved rounds, the slowest rank's:

- **host cost**: what issuing one 8-byte all_reduce costs the host, the device's work
  left out (back-to-back calls timed without a synchronisation, which follows the
  timing; on the device double the device is held meanwhile, as its emulated kernels
  run on the host), with spmd-cupy's cost over the communicator's own call (cupy-nccl);
- **per-call cost**: back-to-back 8-byte all_reduces, then one device synchronisation
  (what a training step with many small buckets pays), in us per call; and one call
  followed by a synchronisation;
- **bus bandwidth** of float32 all_reduces at 64 and 256 MiB (NCCL's convention,
  algbw x 2(n-1)/n).

Implementations: ``spmd-cupy`` (``spmd.all_reduce`` on a cupy array), ``spmd-torch``
(the same on a torch CUDA tensor), ``torch-spmd`` (torch.distributed on the spmd
backend), ``torch-nccl`` (torch.distributed's own NCCL backend) and ``cupy-nccl`` (the
``allReduce`` of the group's ``cupy.cuda.nccl`` communicator: the floor).  What cannot
run here is listed with the reason.  ``--device double`` runs it on
``spmd.testing.device_double`` (no GPU: it shows the program works, not GPU figures).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from spmd.core import cuda as _gpu
from spmd.core.lines import write_lines

__all__ = ["GPU_IMPLS", "HOST_OVER_TARGET", "run_gpu"]

GPU_IMPLS = ("spmd-cupy", "spmd-torch", "torch-spmd", "torch-nccl", "cupy-nccl")
PER_CALL_TARGET, PER_CALL_STRETCH, BANDWIDTH_TARGET = 1.0, 0.5, 0.97
HOST_OVER_TARGET = 10.0   # us: spmd-cupy's host cost per call over cupy-nccl's, at most


def _torch_cuda(spmd: Any) -> tuple[Any, str | None]:
    """(torch with torch.distributed on the spmd backend, None) or (None, why not)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "torch has no CUDA here"
    torch.cuda.set_device(_gpu.bound_device())
    if not dist.is_initialized():
        import spmd.torch  # noqa: F401 - registers the backend where autoload is off

        dist.init_process_group("spmd")
    return torch, None


def _impls(spmd: Any, cp: Any, nbytes: int) -> tuple[dict, dict]:
    """({impl: call}, {impl: why it cannot run}) for a float32 all_reduce of ``nbytes``."""
    count = max(nbytes // 4, 1)
    calls: dict = {}
    missing: dict = {}
    x = cp.ones(count, cp.float32)
    calls["spmd-cupy"] = lambda: spmd.all_reduce(x)
    comm = spmd.GroupMember.WORLD.engine_for("cuda").connect("bench")
    nccl = _gpu.nccl_or_none()
    raw = cp.ones(count, cp.float32)
    float32, add = nccl.NCCL_FLOAT32, nccl.NCCL_SUM

    def raw_all_reduce() -> None:
        # What a caller of the communicator reads per call (once each, as spmd does):
        # the array's address and the current stream; the NCCL type and op are constants
        # to it, as a resolved plan is to spmd.
        ptr = raw.data.ptr
        comm.allReduce(ptr, ptr, count, float32, add, cp.cuda.get_current_stream().ptr)

    calls["cupy-nccl"] = raw_all_reduce
    torch, why = _torch_cuda(spmd)
    if torch is None:
        for name in ("spmd-torch", "torch-spmd", "torch-nccl"):
            missing[name] = why
        return calls, missing
    import torch.distributed as dist

    t = torch.ones(count, dtype=torch.float32, device="cuda")
    calls["spmd-torch"] = lambda: spmd.all_reduce(t)
    t2 = torch.ones(count, dtype=torch.float32, device="cuda")
    calls["torch-spmd"] = lambda: dist.all_reduce(t2)
    try:
        nccl_group = _nccl_group(dist)
    except Exception as exc:  # noqa: BLE001 - a torch build without NCCL, say
        missing["torch-nccl"] = f"{type(exc).__name__}: {exc}"
    else:
        t3 = torch.ones(count, dtype=torch.float32, device="cuda")
        calls["torch-nccl"] = lambda: dist.all_reduce(t3, group=nccl_group)
    return calls, missing


_torch_nccl: list = []


def _nccl_group(dist: Any) -> Any:
    if not _torch_nccl:
        _torch_nccl.append(dist.new_group(backend="nccl"))
    return _torch_nccl[0]


def _measure(spmd: Any, cp: Any, calls: dict, per_round: int, rounds: int) -> dict:
    """Seconds per call of each implementation: medians over interleaved rounds of
    ``per_round`` back-to-back calls and one device synchronisation, slowest rank."""
    from mpi4py import MPI

    sync = cp.cuda.runtime.deviceSynchronize
    comm = spmd.GroupMember.WORLD.comm
    for fn in calls.values():  # warm up: communicators, pinned buffers, kernels
        fn()
    sync()
    times: dict = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(per_round):
                fn()
            sync()
            times[name].append((time.perf_counter() - t0) / per_round)
    names = list(calls)
    mine = np.array([statistics.median(times[k]) for k in names])
    slowest = np.empty_like(mine)
    comm.Allreduce(mine, slowest, MPI.MAX)
    return dict(zip(names, slowest.tolist()))


def _host_cost(spmd: Any, cp: Any, calls: dict, per_round: int, rounds: int,
               double: bool) -> dict:
    """Host seconds per call of each implementation, the device's work left out: medians
    of interleaved rounds of ``per_round`` calls timed without a synchronisation (the
    device is synchronised after each round's timing), slowest rank."""
    from mpi4py import MPI

    hold = release = None
    if double:
        from spmd.testing import device_double

        hold, release = device_double.hold, device_double.release
    sync = cp.cuda.runtime.deviceSynchronize
    comm = spmd.GroupMember.WORLD.comm
    times: dict = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            comm.Barrier()
            if hold is not None:
                hold()
            t0 = time.perf_counter()
            for _ in range(per_round):
                fn()
            times[name].append((time.perf_counter() - t0) / per_round)
            if release is not None:
                release()
            sync()
    names = list(calls)
    mine = np.array([statistics.median(times[k]) for k in names])
    slowest = np.empty_like(mine)
    comm.Allreduce(mine, slowest, MPI.MAX)
    return dict(zip(names, slowest.tolist()))


def _ratio_line(what: str, num: dict, den: dict, a: str, b: str, target: str,
                ok: Any, missing: dict) -> str:
    if a not in num or b not in den:
        gone = b if b not in den else a
        return f"target: {what}, {a} / {b}: not measured ({gone}: {missing.get(gone, '?')})"
    r = num[a] / den[b]
    return f"target: {what}, {a} / {b} = {r:.2f} ({target}): {'met' if ok(r) else 'NOT MET'}"


def run_gpu(args: Any) -> int:
    """Run the GPU bench on every rank; rank 0 prints the table and the target lines."""
    if args.device == "double":
        from spmd.testing import device_double

        device_double.install()
    import spmd

    cp = _gpu.need_cupy("spmd bench", "--device cuda")
    if not spmd.is_initialized():
        spmd.init_process_group(backend="cpu:mpi,cuda:nccl")
    n = spmd.get_world_size()
    small_calls, rounds = (50, 2) if args.quick else (2000, 5)
    big = (64 * 1024, 256 * 1024) if args.quick else (64 * 2**20, 256 * 2**20)
    big_calls = 3 if args.quick else 10

    calls, missing = _impls(spmd, cp, 8)
    # short rounds: a round the host is taken from by another process counts once
    host = _host_cost(spmd, cp, calls, 20, 10 if args.quick else 50, args.device == "double")
    back_to_back = _measure(spmd, cp, calls, small_calls, rounds)
    one_call = _measure(spmd, cp, calls, 1, max(rounds * 20, 40))
    bandwidth: dict = {}
    for nbytes in big:
        big_impls, _ = _impls(spmd, cp, nbytes)
        secs = _measure(spmd, cp, big_impls, big_calls, rounds)
        factor = 2 * (n - 1) / n if n > 1 else 1.0
        bandwidth[nbytes] = {k: nbytes / s * factor / 1e9 for k, s in secs.items()}
    if spmd.get_rank() == 0:
        _report(spmd, cp, n, big, host, back_to_back, one_call, bandwidth, missing)
    return 0


def _size(nbytes: int) -> str:
    return f"{nbytes // 2**20} MiB" if nbytes >= 2**20 else f"{nbytes // 1024} KiB"


def _report(spmd, cp, n, big, host, back_to_back, one_call, bandwidth, missing) -> None:
    head = f"{'impl':12s} {'8 B host':>10s} {'8 B back-to-back':>18s} {'8 B call+sync':>15s}" + \
        "".join(f" {_size(b) + ' busbw':>15s}" for b in big)
    units = f"{'':12s} {'us/call':>10s} {'us/call':>18s} {'us':>15s}" + \
        "".join(f" {'GB/s':>15s}" for _ in big)
    lines = [f"GPU all_reduce (float32), {n} rank(s), {_gpu.gpu_info().get('cuda_device')}, "
             f"NCCL {_gpu.nccl_version()}", head, units]
    for name in GPU_IMPLS:
        if name not in back_to_back:
            continue
        lines.append(f"{name:12s} {host[name] * 1e6:10.1f} {back_to_back[name] * 1e6:18.1f} "
                     f"{one_call[name] * 1e6:15.1f}" +
                     "".join(f" {bandwidth[b].get(name, float('nan')):15.3g}" for b in big))
    over = (host["spmd-cupy"] - host["cupy-nccl"]) * 1e6
    lines.append(f"target: 8 B host cost per call, spmd-cupy - cupy-nccl = {over:.1f} us "
                 f"(<= {HOST_OVER_TARGET:g} us): {'met' if over <= HOST_OVER_TARGET else 'NOT MET'}")
    for name, why in missing.items():
        lines.append(f"not run: {name} ({why})")
    for impl in ("spmd-cupy", "spmd-torch", "torch-spmd"):
        lines.append(_ratio_line("8 B back-to-back time per call", back_to_back, back_to_back,
                                 impl, "torch-nccl",
                                 f"<= {PER_CALL_TARGET:g}, stretch {PER_CALL_STRETCH:g}",
                                 lambda r: r <= PER_CALL_TARGET, missing))
    for b in big:
        lines.append(_ratio_line(f"{_size(b)} bus bandwidth", bandwidth[b], bandwidth[b],
                                 "spmd-cupy", "cupy-nccl", f">= {BANDWIDTH_TARGET:g}",
                                 lambda r: r >= BANDWIDTH_TARGET, missing))
    if n == 1:   # one rank (--one-rank): the targets are about ranks talking
        lines = [line for line in lines if not line.startswith("target:")]
    write_lines("\n".join(lines))
