"""How a job that lost ranks ends: without Open MPI's finalize fence.

Open MPI 5's ``MPI_Finalize`` begins with a PMIx fence over the job's ranks.  After a
rank died (ULFM, ``mpiexec --with-ft ulfm``), that fence usually completes without it,
and sometimes waits for it forever: on a loaded machine about one job in 25 had every
survivor stuck in ``ompi_mpi_finalize`` after its last line of output (seen with gdb;
Open MPI 5.0.11).  The survivors have nothing left to say to the dead rank, and Open
MPI's runtime under ``--with-ft ulfm`` accepts a rank that exits without finalizing
(status 0, no complaint), so a job that saw a rank die skips ``MPI_Finalize``.

:func:`prepare` runs at ``import spmd`` (before MPI starts) in a job started with ULFM
fault tolerance only: mpi4py then leaves finalizing to spmd (``mpi4py.rc.finalize``),
and spmd finalizes at exit as mpi4py would have, unless :func:`note_failure` was called.
Elsewhere nothing changes.  A program that imported ``mpi4py.MPI`` before spmd keeps
mpi4py's own finalize.
"""

from __future__ import annotations

import atexit
import os
import sys

__all__ = ["prepare", "note_failure", "note_replacement"]

_failure_seen = False
_must_finalize = False
_prepared = False


def _ulfm_job() -> bool:
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true",
                                                                            "yes", "on")


def prepare() -> None:
    """In a ULFM job whose MPI has not started yet: finalizing becomes spmd's."""
    global _prepared
    if _prepared or not _ulfm_job() or "mpi4py.MPI" in sys.modules:
        return
    import mpi4py  # the package only (MPI starts at mpi4py.MPI), and only in ULFM jobs

    mpi4py.rc.finalize = False
    atexit.register(_finalize)   # registered first, so it runs after spmd's other handlers
    _prepared = True


def note_failure() -> None:
    """A rank of this job died: the process ends without MPI_Finalize."""
    global _failure_seen
    _failure_seen = True


def note_replacement() -> None:
    """This process was started by healing with ``MPI_Comm_spawn`` (where Open MPI's PMIx
    could not be reached: spmd.backends.mpi.recoverable_spawn), in a job of its own that
    the launcher did not start fault tolerant: it must end with MPI_Finalize, even after
    a failure, or the launcher takes its exit for a crash and ends everything.  A
    process started as a recoverable job leaves as its peers do."""
    global _must_finalize
    _must_finalize = True


def _finalize() -> None:
    if _failure_seen and not _must_finalize:
        return
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
