"""The ``spmd`` command: ``spmd info`` (what each rank runs on), ``spmd bench``
(collective latency and bandwidth) and ``spmd trace-merge`` (one trace for a job)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from spmd.core.lines import write_lines

__all__ = ["main"]


def _rank_info() -> dict:
    import mpi4py
    import numpy as np
    from mpi4py import MPI

    from spmd._version import __version__
    from spmd.backends.gpu_aware_mpi import mpi_gpu_support
    from spmd.backends.mpi import fastcall
    from spmd.backends.shm.engine import status as shm_status
    from spmd.core.arrays import bfloat16
    from spmd.core.cuda import gpu_info
    from spmd.core.launch import launch_info
    from spmd.runtime.group import default_group
    from spmd.runtime.world import get_node_local_rank

    levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
              MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    launch = launch_info()
    try:
        support = mpi_gpu_support()
        gpu_aware = f"{'yes' if support.aware else 'no'} ({support.reason})"
    except ValueError as exc:   # SPMD_CUDA_AWARE_MPI set to something else than 0 or 1
        gpu_aware = f"unknown ({exc})"
    return {
        "rank": MPI.COMM_WORLD.Get_rank(),
        "host": launch.hostname,
        "node_local_rank": get_node_local_rank(),
        "launcher": launch.launcher,
        "job_id": launch.job_id,
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "thread_level": levels.get(MPI.Query_thread(), str(MPI.Query_thread())),
        "spmd": __version__,
        "mpi4py": mpi4py.__version__,
        "numpy": np.__version__,
        "bfloat16": "ml_dtypes" if bfloat16 is not None else "unavailable",
        "shm_engine": shm_status(default_group("info").engine_for("cpu")),  # every rank calls it
        "call_path": ("compiled (spmd.backends.mpi._fastcall)" if fastcall.compiled is not None
                      else f"Python: {fastcall.reason}"),
        "gpu_aware_mpi": gpu_aware,
        **gpu_info(),
    }


def info(args) -> int:
    """Print, on rank 0, one block per rank: MPI library, thread level, versions, and
    for GPUs: whether MPI is GPU-aware (and how that was decided), CuPy, NCCL, the device."""
    import spmd

    spmd.init_process_group()
    try:
        rows: list[Any] = [None] * spmd.get_world_size()
        spmd.all_gather_object(rows, _rank_info())
        if spmd.get_rank() == 0:
            lines = [f"spmd info: {len(rows)} rank(s)"]
            for row in rows:
                lines.append(f"rank {row['rank']}:")
                lines += [f"  {key:16s} {value}" for key, value in row.items() if key != "rank"]
            write_lines("\n".join(lines))
    finally:
        spmd.destroy_process_group()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="spmd", description="spmd command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="print what every rank runs on (run under mpiexec)")
    p_info.set_defaults(func=info)
    from spmd.tools import bench, trace

    p_bench = sub.add_parser("bench", help="collective latency and bandwidth vs raw mpi4py "
                             "and torch gloo (run under mpiexec with 2 or more ranks: "
                             "mpiexec -n 2 spmd bench)")
    bench.add_arguments(p_bench)
    p_bench.set_defaults(func=bench.bench_command)
    trace.add_merge_arguments(sub.add_parser("trace-merge", help="merge per-rank trace files "
                                             "(SPMD_TRACE) into one"))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
