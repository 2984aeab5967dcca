"""The MPI engine's persistent collectives (MPI-4 ``MPI_*_init``): whether the library
runs them (asked by using them), the requests of each planned op, and their starts.

:mod:`spmd.api.persistent` makes the plans (validation, the fallback to nonblocking
collectives, debug mode's checks) and calls this module for everything MPI.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
from mpi4py import MPI

from spmd.backends.mpi.work import MPIWork
from spmd.backends.reduction import ReductionPlan, mpi_view
from spmd.core import settings
from spmd.core.arrays import movable
from spmd.core.context import GroupContext

__all__ = ["available", "native_on", "agree", "persistent_collectives_work",
           "restarts_correctly", "all_reduce", "all_reduce_buffers", "broadcast", "reduce",
           "all_gather", "reduce_scatter", "all_to_all", "barrier", "start", "free"]

_IN_PLACE = MPI.IN_PLACE
_startall = MPI.Prequest.Startall

# Per group: whether its communicator restarts a persistent collective correctly.
_restarts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def available() -> bool:
    """True when this MPI library runs persistent collectives and they are not turned
    off with ``SPMD_PERSISTENT=0``."""
    if not settings.read("SPMD_PERSISTENT"):
        return False
    global _works
    if _works is None:
        _works = persistent_collectives_work(MPI.COMM_SELF)
    return _works


_works: bool | None = None   # the probe's answer, once asked


def restarts_correctly(comm: MPI.Intracomm) -> bool:
    """Whether a persistent all-gather on ``comm`` gives every rank the right result when
    started again with new input; collective, the same answer on every rank.

    Intel MPI 2021.18 at 2 and 4 ranks leaves a rank's own block one start behind (the
    second start returns the first start's input there), so a group whose library does
    that runs its plans as nonblocking collectives instead."""
    n, rank = comm.Get_size(), comm.Get_rank()
    send, recv = np.zeros(2, np.int32), np.zeros(2 * n, np.int32)
    req = comm.Allgather_init(send, recv)
    ok = True
    try:
        for step in (1, 2):
            send[:] = 10 * rank + step
            req.Start()
            req.Wait()
            ok = ok and bool((recv == np.repeat(10 * np.arange(n) + step, 2)).all())
    finally:
        req.Free()
    return bool(comm.allreduce(ok, op=MPI.LAND))


def persistent_collectives_work(comm: MPI.Intracomm) -> bool:
    """Whether ``comm``'s library runs a persistent all-reduce: made, started twice and
    freed, with the right result.  Asked of the library by using it, not of its version
    number (Open MPI 5 says MPI 3.1 and has them).  A library gives every rank the same
    answer, so ranks that ask on COMM_SELF agree without a message."""
    send, recv = np.array([3], np.int32), np.zeros(1, np.int32)
    try:
        req = comm.Allreduce_init(send, recv)
    except (NotImplementedError, AttributeError, MPI.Exception):
        return False
    try:
        for value in (3, 5):
            send[0] = value
            req.Start()
            req.Wait()
            if recv[0] != value * comm.Get_size():
                return False
    except MPI.Exception:
        return False
    finally:
        req.Free()
    return True


def native_on(group: GroupContext) -> bool:
    """Whether ``group``'s plans may be the library's persistent collectives: the library
    has them, and (asked once per group, of every rank) restarts them correctly."""
    if not available():
        return False
    verdict = _restarts.get(group)
    if verdict is None:
        verdict = _restarts[group] = group.size == 1 or restarts_correctly(group.comm)
    return verdict


def agree(group: GroupContext, ok: bool) -> bool:
    """True on every rank if ``ok`` is on every rank of ``group`` (both sides of a plan
    must be the same kind everywhere: an MPI_Start does not match a nonblocking
    collective)."""
    return ok if group.size == 1 else bool(group.comm.allreduce(ok, op=MPI.LAND))


# -- the requests of each planned op ---------------------------------------------------

def all_reduce(group: GroupContext, a: np.ndarray, plan: ReductionPlan) -> MPI.Prequest:
    return group.comm.Allreduce_init(_IN_PLACE, mpi_view(a, plan), plan.mpi_op)


def all_reduce_buffers(group: GroupContext, bufs: list, plan: ReductionPlan) -> list:
    """One in-place persistent all-reduce per buffer (the fused buckets of a dtype)."""
    reqs: list = []
    try:
        for buf in bufs:
            reqs.append(group.comm.Allreduce_init(_IN_PLACE, mpi_view(buf, plan), plan.mpi_op))
    except BaseException:
        free(reqs)
        raise
    return reqs


def broadcast(group: GroupContext, a: np.ndarray, root: int) -> MPI.Prequest:
    return group.comm.Bcast_init(movable(a), root)


def reduce(group: GroupContext, a: np.ndarray, plan: ReductionPlan, root: int) -> MPI.Prequest:
    if group.rank == root:
        return group.comm.Reduce_init(_IN_PLACE, mpi_view(a, plan), plan.mpi_op, root)
    return group.comm.Reduce_init(mpi_view(a, plan), None, plan.mpi_op, root)


def all_gather(group: GroupContext, out: np.ndarray, a: np.ndarray) -> MPI.Prequest:
    return group.comm.Allgather_init(movable(a), movable(out))


def reduce_scatter(group: GroupContext, out: np.ndarray, a: np.ndarray,
                   plan: ReductionPlan) -> MPI.Prequest:
    return group.comm.Reduce_scatter_block_init(mpi_view(a, plan), mpi_view(out, plan),
                                                plan.mpi_op)


def all_to_all(group: GroupContext, out: np.ndarray, a: np.ndarray) -> MPI.Prequest:
    return group.comm.Alltoall_init(movable(a), movable(out))


def barrier(group: GroupContext) -> MPI.Prequest:
    return group.comm.Barrier_init()


# -- starts ------------------------------------------------------------------------------

class _AllOf:
    """Several started persistent requests as one, for a Work: complete when all are.

    Not ``Testall``: MPICH 5.0.2's fails with MPI_ERR_IN_STATUS ("pending request") when
    some persistent collective requests of the list are complete and others are not.
    """

    __slots__ = ("_reqs",)

    def __init__(self, reqs: list):
        self._reqs = reqs

    def Test(self, status: Any = None) -> bool:  # noqa: N802 - an MPI request's name
        for req in self._reqs:   # a completed persistent request tests true again
            if not req.Test():
                return False
        return True


def start(reqs: Any, name: str, group: GroupContext, outputs: list, finish: Any,
          keep: Any) -> MPIWork:
    """Start a plan's request (or its list of requests, together); its Work."""
    if type(reqs) is not list:
        reqs.Start()
        return MPIWork([reqs], name, group, outputs, finish=finish, keep=keep)
    _startall(reqs)
    return MPIWork([_AllOf(reqs)], name, group, outputs, finish=finish, keep=keep)


def free(reqs: Any) -> None:
    """Free a plan's request (or its list of requests)."""
    for req in reqs if type(reqs) is list else [reqs]:
        req.Free()
