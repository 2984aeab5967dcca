"""Several programs in one MPI job (MPMD): a group per program, and links between them.

``mpiexec -n 2 python ocean.py : -n 2 python atmos.py`` (or ``srun --multi-prog``, or a
SLURM hetjob) starts one MPI job whose WORLD holds every program's ranks.  Each rank
calls :func:`~spmd.init_program` with its program's name and gets its program's group;
:func:`~spmd.new_link` connects two programs with an MPI intercommunicator over which
arrays and objects travel, addressed by rank *within the other program*.

Program identity comes from the name the program passes, which works under every
launcher.  Without a name, ``MPI_APPNUM`` is used where the launcher sets it (Hydra's
``mpiexec a : b`` sets 0 and 1); ``srun --multi-prog`` and hetjobs never set it.

A :class:`~spmd.Link` is the MPI engine's transport (:mod:`spmd.backends.mpi.link`): GPU
(cupy) arrays travel as the MPI engine moves them, through device memory where MPI is
GPU-aware, else staged through pinned host memory; NCCL cannot serve a link, since its
communicators never span two groups.  In debug mode
(``SPMD_DEBUG=DETAIL``) the link broadcasts compare their fingerprint across every rank
of both programs before anything moves.
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd.backends.mpi import job as mpi_job
from spmd.backends.mpi.link import Link
from spmd.core.typing import Timeout
from spmd.runtime.group import ProcessGroup, default_group, split_comm, timeout_seconds, world_state

__all__ = ["Link", "Program", "get_program", "get_programs", "init_program", "new_link"]


@dataclass(frozen=True)
class Program:
    """One program of the job: its name, its index (programs are numbered by their
    lowest world rank), the world ranks running it (in program-rank order) and the
    ``MPI_APPNUM`` the launcher gave it (None if unset)."""

    name: str
    index: int
    ranks: tuple[int, ...]
    appnum: int | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)


class _Job:
    """What init_program found: the programs, this rank's one and its group."""

    def __init__(self, world, programs, mine, group, peer_comm):
        self.world = world
        self.programs: list[Program] = programs
        self.mine: Program = mine
        self.group: ProcessGroup = group
        self.peer_comm = peer_comm  # private to link set-up: leaders talk here only


_job: _Job | None = None


def init_program(name: str | None = None, *, timeout: Timeout | None = None,
                 backend: str | None = None) -> ProcessGroup:
    """Find the programs of this job and return the group of this rank's program.

    Every rank of WORLD (of every program) must call it.  Ranks of one program must
    pass the same name, and programs the launcher started separately different names;
    ranks of one launched program may take several names (one script playing two roles).

    Args:
        name: this program's name, e.g. ``"ocean"``.  If None, the program is
            ``f"app{MPI_APPNUM}"``, which needs a launcher that sets MPI_APPNUM.

    Raises:
        ValueError: on every rank, when some rank gave no name and has no MPI_APPNUM,
            or names and MPI_APPNUM disagree.
    """
    global _job
    op = "init_program"
    world = default_group(op)
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise TypeError(f"{op}: name must be a non-empty str or None, got {name!r}")
    rows = world.context.comm.allgather((name, mpi_job.app_number()))
    # Every rank sees the same rows, so every rank raises the same error.
    unnamed = [r for r, (n, a) in enumerate(rows) if n is None and a is None]
    if unnamed:
        raise ValueError(f"{op}: ranks {unnamed} passed no program name and the launcher did "
                         "not set MPI_APPNUM (srun --multi-prog and SLURM hetjobs never do); "
                         "pass init_program(name=...) in every program")
    names = [n if n is not None else f"app{a}" for n, a in rows]
    # One launched program may play several roles (names); two launched programs may
    # not share one name, the mark of a copied script.
    by_name: dict[str, int] = {}
    for n, (_, a) in zip(names, rows):
        if a is not None and by_name.setdefault(n, a) != a:
            raise ValueError(f"{op}: program name {n!r} is used by the programs started as "
                             f"MPI_APPNUM {by_name[n]} and {a}; give each program its own name")
    order = list(dict.fromkeys(names))  # by lowest world rank
    programs = [Program(n, i, tuple(r for r, m in enumerate(names) if m == n),
                        rows[names.index(n)][1]) for i, n in enumerate(order)]
    mine = programs[order.index(names[world.context.rank])]
    group = split_comm(world, mine.index, world.context.rank, lambda m: f"program:{mine.name}", timeout,
                   backend, f"program_{mine.name}", op)
    if _job is not None and _job.world is world and _job.peer_comm is not None:
        _job.peer_comm.Free()
    _job = _Job(world, programs, mine, group, world.context.comm.Dup())
    return group


def _current(op: str) -> _Job:
    if _job is None or _job.world is not world_state.world:
        raise RuntimeError(f"{op}: the programs are not known; call spmd.layouts.mpmd.init_program() "
                           "on every rank first")
    return _job


def get_programs() -> list[Program]:
    """Every program of the job, in index order (by lowest world rank)."""
    return list(_current("get_programs").programs)


def get_program(name: str | None = None) -> Program:
    """The program called ``name``, or this rank's program if None.

    Raises:
        ValueError: no program has that name.
    """
    job = _current("get_program")
    if name is None:
        return job.mine
    for p in job.programs:
        if p.name == name:
            return p
    raise ValueError(f"get_program: no program named {name!r}; the programs are "
                     f"{[p.name for p in job.programs]}")


def new_link(peer: str, *, timeout: Timeout | None = None) -> Link:
    """Connect this rank's program with program ``peer``.

    Every rank of both programs must call it (each naming the other program), and two
    programs create their links in the same order.

    Raises:
        ValueError: ``peer`` is this program or no program of the job.
    """
    op = "new_link"
    job = _current(op)
    remote = get_program(peer) if isinstance(peer, str) else None
    if remote is None:
        raise TypeError(f"{op}: peer must be a program name (str), got {type(peer).__name__}")
    if remote.name == job.mine.name:
        raise ValueError(f"{op}: peer {peer!r} is this rank's own program; a link joins two "
                         f"different programs of {[p.name for p in job.programs]}")
    seconds = job.group.context.timeout if timeout is None else timeout_seconds(timeout, op)
    lo, hi = sorted((job.mine.index, remote.index))
    tag = 1 + lo * len(job.programs) + hi  # the same on both sides, distinct per pair
    comm = job.group.context.comm.Create_intercomm(0, job.peer_comm, remote.ranks[0], tag)
    # spmd's own link traffic (objects, broadcast relays) never meets the user's.
    return Link(comm, comm.Dup(), job.group.context.comm.Dup(), job.mine, remote, seconds)
