"""Set-up collectives done on first use, under the group's deadline.

An engine makes some of its state the first time an op needs it (the shared-memory
engine's window, the NCCL communicator's unique id), with blocking collectives that MPI
cannot time out (``MPI_Comm_split_type``, ``MPI_Win_allocate_shared``, a bcast).  A rank
that reaches them after a peer gave up waiting would block there forever; so every
set-up goes through :func:`set_up`:

1. a nonblocking barrier on the group, waited for under the group's timeout: a rank
   whose peers do not come gets the diagnosed DistTimeoutError (the barrier's request is
   held, see :mod:`spmd.backends.mpi.orphans`, and the group broken, its peers told);
2. the group checked again: a peer that gave up breaks it and says so, and a rank that
   arrives after that raises GroupBrokenError instead of going on;
3. the blocking calls on a thread of their own, waited for under the group's timeout,
   so that a rank whose peer gave up in the instant between 1 and 3 still gets a
   diagnosed timeout rather than a hang (the thread stays blocked in MPI; the group is
   broken).  Without ``MPI_THREAD_MULTIPLE`` they run on the caller's thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from mpi4py import MPI

from spmd.backends.mpi import orphans
from spmd.core.context import GroupContext
from spmd.core.errors import DistTimeoutError
from spmd.core.wait import wait_until

__all__ = ["run_blocking", "set_up"]

T = TypeVar("T")


def set_up(group: GroupContext, op: str, what: str, fn: Callable[[], T]) -> T:
    """Run ``fn``, blocking collective set-up over ``group`` that every member runs when
    it reaches ``op``, so that no member waits for it past the group's timeout.

    Args:
        group: the group whose members all run the set-up.
        op: the op that needs it, for errors.
        what: what is set up, for errors ("the shared-memory engine").
        fn: the blocking calls; its result is returned, its exception raised.

    Raises:
        DistTimeoutError: a member did not come within the group's timeout.
        GroupBrokenError: a member gave the set-up (or an earlier op) up meanwhile.
    """
    source = f"setting up {what}"
    gate = group.comm.Ibarrier()
    try:
        wait_until(gate.Test, group.timeout, op, group, source=source)
    except BaseException:
        if gate:   # still pending: a late peer's barrier may still match it
            orphans.hold([gate], None)
            group.mark_broken(f"{op}: {source} was given up on rank {group.rank}")
        raise
    group.check_alive(op)
    return run_blocking(group, op, source, fn, group.timeout, on_give_up=lambda: group.mark_broken(
        f"{op}: {source} was given up on rank {group.rank}"))


def run_blocking(group: GroupContext, op: str, source: str, fn: Callable[[], T],
                 seconds: float, kind: str = "collective",
                 on_give_up: Callable[[], None] | None = None, patience: int = 0) -> T:
    """Run ``fn`` (blocking MPI calls that cannot be timed out) on a thread of its own
    and wait for it under ``seconds``, with the one wait helper: a member found dead
    meanwhile raises its failure, a member that does not come the diagnosed timeout (for
    ``kind`` "recovery": the members that do not answer are taken for hung, and where
    the job survives that, ended).  With ``patience``, a timeout that found every member
    alive and answering (nobody hung: MPI is slow, as on a loaded machine) waits that
    many more periods of ``seconds`` before it raises.  The thread stays blocked in MPI
    after a timeout; ``on_give_up`` runs then.  Without ``MPI_THREAD_MULTIPLE`` it runs
    on the caller's thread."""
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        return fn()
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"spmd {source}", daemon=True)
    thread.start()
    for waited in range(patience + 1):
        try:
            wait_until(lambda: not thread.is_alive(), seconds, op, group,
                       nap=lambda: thread.join(0.001), source=source, kind=kind)
            break
        except DistTimeoutError:
            if waited < patience:
                continue   # every member answered: none of them is hung
            if on_give_up is not None:
                on_give_up()
            raise
        except BaseException:
            if on_give_up is not None:
                on_give_up()
            raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
