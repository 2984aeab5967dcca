"""How ``spmd bench`` times calls: interleaved rounds, every rank alike, the slowest
rank's time per call (the host sweep, ``bench.py``, and the torch mode, ``bench_torch.py``)."""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

__all__ = ["measure"]

_pc = time.perf_counter


def _agreed_max(comm, values: list[float]) -> np.ndarray:
    arr = np.array(values, np.float64)
    comm.Allreduce(MPI.IN_PLACE, arr, MPI.MAX)
    return arr


def measure(comm, impls: dict, cfg) -> dict[str, np.ndarray]:
    """Per-call times of each implementation (seconds, the slowest rank's per call).

    The number of calls is the same for every implementation and agreed by all ranks:
    about ``cfg.budget`` seconds in all, within ``[cfg.min_iters, cfg.max_iters]``.
    """
    names = list(impls)
    first_times: list[float] = []
    for name in names:  # one call each tells how many more warm-up calls are affordable
        comm.Barrier()
        t0 = _pc()
        impls[name]()
        first_times.append(_pc() - t0)
    first = _agreed_max(comm, first_times)
    extra = int(max(0, min(cfg.warmup - 1, 0.25 * cfg.budget / max(first.sum(), 1e-9))))
    est_times: list[float] = []
    for i, name in enumerate(names):
        fn = impls[name]
        comm.Barrier()
        t0 = _pc()
        for _ in range(extra):
            fn()
        est_times.append((_pc() - t0) / extra if extra else first[i])
    est = _agreed_max(comm, est_times)
    iters = int(min(cfg.max_iters, max(cfg.min_iters, cfg.budget / max(est.sum(), 1e-9))))
    rounds = max(1, min(cfg.rounds, iters))
    per_round = -(-iters // rounds)
    chunks: dict[str, list] = {name: [] for name in names}
    for r in range(rounds):
        for j in range(len(names)):
            name = names[(j + r) % len(names)]  # rotate who goes first
            fn = impls[name]
            comm.Barrier()
            stamps = [_pc()]
            stamp = stamps.append
            for _ in range(per_round):
                fn()
                stamp(_pc())
            chunks[name].append(np.diff(np.array(stamps)))
    out = {}
    for name in names:
        s = np.concatenate(chunks[name])
        comm.Allreduce(MPI.IN_PLACE, s, MPI.MAX)
        out[name] = s
    return out

