"""Run pytest on every rank of an MPI job; only rank 0 writes to the terminal.

Usage: mpiexec -n N python tests/mpi_pytest.py LOGDIR [pytest args...]

Ranks other than 0 write their full report to LOGDIR/rank<R>.log (printed by
tests/run.sh when the job fails).  The job's exit status is non-zero if any rank failed.
"""

import importlib.util
import os
import sys

import pytest


def main() -> int:
    from mpi4py import MPI

    logdir, args = sys.argv[1], sys.argv[2:]
    rank = MPI.COMM_WORLD.Get_rank()
    if rank != 0:
        os.makedirs(logdir, exist_ok=True)
        log = open(os.path.join(logdir, f"rank{rank}.log"), "w")
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = log
    # pytest-mpi runs the mpi-marked tests only with --with-mpi; without the plugin
    # (a bare GPU machine) nothing skips them and the option would be an error.
    with_mpi = ["--with-mpi"] if importlib.util.find_spec("pytest_mpi") is not None else []
    code = pytest.main([*with_mpi, *args])
    sys.stdout.flush()
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
