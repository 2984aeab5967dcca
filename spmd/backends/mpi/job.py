"""The MPI job this process is in, as a whole: its place in ``COMM_WORLD``, the program
number its launcher gave it, and ending every process of it (``MPI_Abort``).

Importing this module starts MPI (``from mpi4py import MPI``), as the modules above that
ask it would.
"""

from __future__ import annotations

from mpi4py import MPI

__all__ = ["abort", "app_number", "world_rank", "world_size"]


def world_rank() -> int:
    """This process's rank in ``COMM_WORLD``."""
    return MPI.COMM_WORLD.Get_rank()


def world_size() -> int:
    """The number of processes in ``COMM_WORLD``."""
    return MPI.COMM_WORLD.Get_size()


def app_number() -> int | None:
    """``MPI_APPNUM``: which program of an MPMD launch this process runs, in the
    launcher's numbering (``mpiexec -n 2 a : -n 3 b`` gives 0 and 1), or None where the
    launcher sets none."""
    value = MPI.COMM_WORLD.Get_attr(MPI.APPNUM)
    return None if value is None else int(value)


def abort(code: int) -> None:
    """End every process of the job with exit status ``code`` (``MPI_Abort`` on
    ``COMM_WORLD``).  Some MPIs (MPICH) return from it while the launcher tears the job
    down: the caller must not go on."""
    MPI.COMM_WORLD.Abort(code)
