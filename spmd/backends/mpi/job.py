"""The MPI job this process is in, as a whole: its place in ``COMM_WORLD``, the program
number its launcher gave it, and ending every process of it (``MPI_Abort``, and on
Open MPI the processes its launcher started beside this one).

Importing this module starts MPI (``from mpi4py import MPI``), as the modules above that
ask it would.
"""

from __future__ import annotations

import contextlib
import os
import signal

from mpi4py import MPI

__all__ = ["abort", "app_number", "kill_launched_here", "process_stat", "world_rank",
           "world_size"]

# Open MPI's launcher daemons: every process of a job (and of the jobs MPI_Comm_spawn
# started from it) on a node is a child of the node's one daemon.
_OPEN_MPI_DAEMONS = ("prterun", "prted", "mpirun", "mpiexec")


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


def process_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command (``[0]`` the state, ``[1]`` the
    parent's pid, ``[19]`` the start time in clock ticks), or None for no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _children_of(ppid: int) -> list[int]:
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        fields = process_stat(int(entry))
        if fields is not None and int(fields[1]) == ppid:
            out.append(int(entry))
    return out


def kill_launched_here(known: list[int]) -> list[int]:
    """SIGKILL the other processes of this job on this node: ``known`` (pids this job
    learnt) and, where this process's parent is Open MPI's launcher daemon, every other
    child of it (the jobs MPI_Comm_spawn started count: under ULFM, ``MPI_Abort`` ends only
    the job of the process that calls it, and a process spawned by the survivors, or one
    not yet joined, belongs to another).  A stopped process is killed too.  The pids
    signalled."""
    me, ppid = os.getpid(), os.getppid()
    pids = set(known)
    try:
        with open(f"/proc/{ppid}/comm") as f:
            daemon = f.read().strip()
    except OSError:
        daemon = ""
    if daemon in _OPEN_MPI_DAEMONS:
        pids.update(_children_of(ppid))
    pids.discard(me)
    done = []
    for pid in sorted(pids):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            done.append(pid)
    return done
