"""The one wait loop: every place that waits for other ranks polls through here.

``wait_until`` polls a test until it passes, gives the core away between polls when
ranks outnumber cores, naps between them once the wait has lasted
``NAP_AFTER_SECONDS``, and past the deadline raises the DistTimeoutError that the
reliability layer (``spmd.runtime.diagnosis``) composes: where the other ranks are, the group
marked broken for a collective, the flight recorder dumped.  Without that layer (before
init, or in a bare engine test) the error says what timed out and where.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from spmd.core import settings
from spmd.core.context import GroupContext
from spmd.core.errors import DistError, DistTimeoutError
from spmd.core.optable import is_p2p

__all__ = ["wait_until", "timeout_error", "set_oversubscribed", "set_diagnosis",
           "set_failure_check", "NAP_SECONDS", "NAP_AFTER_SECONDS"]

_monotonic = time.monotonic
_yield = os.sched_yield
_sleep = time.sleep

# A napping wait sleeps this long between polls (spmd.backends.mpi._fastcall's waits nap
# as long): its core goes to other processes, and a completion is seen within about
# this long (plus the kernel's timer slack, some 50 us).
NAP_SECONDS = 20e-6
# A wait that has lasted this long is for a late peer, not for the transfer: it naps
# from then on (SPMD_WAIT=auto and yield), so that ranks waiting for a straggler, a
# checkpoint or a rank being debugged leave the node's cores to the processes that work.
# A completion then takes a nap longer to be seen: ~0.1 ms on a wait of 20 ms or more.
NAP_AFTER_SECONDS = 0.02

# True when this node runs more ranks than it has cores (the shared-memory engine sizes
# its slots and thresholds for it).
oversubscribed = False
# True when waiting ranks give their core away between polls (sched_yield: the peer on
# the core runs at once) instead of spinning on it: on an oversubscribed node
# (SPMD_WAIT=auto), or always (SPMD_WAIT=yield: cores shared with other jobs or
# threads, which a spinning wait would starve).
yields = False
# Seconds after which a wait naps between polls; -1: never (SPMD_WAIT=spin).
nap_after = NAP_AFTER_SECONDS

# diagnose(op, group, seq, kind, waited, source, work) -> message, or the error that
# replaces the timeout (a hung rank ended, the job healing); set at init.
_diagnose: Callable[..., str | BaseException] | None = None


# failure_check(op, group) -> the error of a dead member of group, or None; set by the
# runtime once a rank is known dead (ULFM), None before: a wait checks it with its clock.
_failure_check: Callable[[str, GroupContext], BaseException | None] | None = None


def set_failure_check(fn: Callable[[str, GroupContext], BaseException | None] | None) -> None:
    global _failure_check
    _failure_check = fn


def set_oversubscribed(flag: bool) -> None:
    """Say whether this node runs more ranks than it has cores; whether waits yield
    follows from it and SPMD_WAIT."""
    global oversubscribed, yields, nap_after
    oversubscribed = bool(flag)
    mode = settings.read("SPMD_WAIT")
    yields = mode == "yield" or (mode == "auto" and oversubscribed)
    nap_after = -1.0 if mode == "spin" else NAP_AFTER_SECONDS


def set_diagnosis(fn: Callable[..., str | BaseException] | None) -> None:
    """Install the function that turns a timeout into its diagnosis (None removes it)."""
    global _diagnose
    _diagnose = fn


def timeout_error(op: str, group: GroupContext, waited: float, *, seq: int | None = None,
                  kind: str = "collective", source: str = "wait",
                  work: Any = None) -> DistError:
    """The DistTimeoutError for ``op`` on ``group`` after ``waited`` seconds; or the
    error the diagnosis turned it into (where the job survives hung ranks, their
    failure: ProcessFailedError)."""
    plain = (f"{op}: did not complete within {waited:.1f} s "
             f"[rank {group.rank}, group {group.name}]")
    if _diagnose is None:
        return DistTimeoutError(plain)
    try:
        found = _diagnose(op, group, seq, kind, waited, source, work)
        if isinstance(found, DistError):
            return found
        return DistTimeoutError(found)
    except Exception as err:  # noqa: BLE001 - a failed diagnosis must not hide the timeout
        return DistTimeoutError(f"{plain} (diagnosis failed in {_where(err)}: "
                                f"{type(err).__name__}: {err})")


def _where(err: BaseException) -> str:
    """The innermost frame that raised ``err``: function, file and line (a diagnosis
    that fails says where, so that its cause can be found from one log)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "?"
    code = tb.tb_frame.f_code
    return f"{code.co_name} ({os.path.basename(code.co_filename)}:{tb.tb_lineno})"


# How long a wait whose group broke meanwhile still tests its op: a peer that broke it by
# leaving (its exit) or giving up may have done so just after the op completed for it.
BROKEN_GRACE = 0.25


def _last_look(test: Callable[[], Any], error: Exception, group: GroupContext) -> None:
    """The group broke during a wait: return if the op completes within the grace,
    else raise ``error``."""
    end = _monotonic() + BROKEN_GRACE
    while _monotonic() < end:
        if test():
            return
        _yield()
    group.break_for_departure()
    raise error


def wait_until(test: Callable[[], Any], seconds: float, op: str, group: GroupContext, *,
               seq: int | None = None, kind: str = "collective", source: str = "wait",
               work: Any = None, nap: Callable[[], None] | None = None,
               on_timeout: Callable[[], bool | None] | None = None) -> None:
    """Poll ``test()`` until it is true; raise DistTimeoutError after ``seconds``.

    Args:
        test: returns true when the wait is over (an MPI request's ``Test``...).
        seconds: the deadline, from now.
        op, group: what is waited for, for the message.
        seq, kind, source, work: what the diagnosis reports (the op's sequence number,
            "collective" or "p2p", which wait timed out, the Work if there is one).
        nap: what to do between polls (default: yield the core where waits yield, and
            nap once the wait has lasted ``nap_after``).
        on_timeout: called past the deadline, before the error is raised (NCCL aborts
            its communicator; an MPI Work gives its op up); if it returns True the op
            completed after all (a cancelled receive whose message had matched) and the
            wait ends without an error.

    Raises:
        DistTimeoutError: past the deadline.
        GroupBrokenError, ProcessFailedError: the group broke meanwhile (a peer's
            timeout, told over the control channel; a member died).
    """
    start = _monotonic()
    deadline = start + seconds
    nap_from = start + nap_after if nap_after >= 0 else float("inf")
    napping = False
    spins = 0
    while not test():
        spins += 1
        if nap is not None:
            nap()
        elif napping:
            _sleep(NAP_SECONDS)
        elif yields:
            _yield()
        if spins & 255:
            continue
        if _failure_check is not None:
            failed = _failure_check(op, group)
            if failed is not None:
                raise failed
        if group.error is not None or group.departed is not None:
            # Broken meanwhile, or a member exited: the op may never complete.
            error = group.wait_error(op, collective=not is_p2p(op))
            if error is not None:
                _last_look(test, error, group)
                return
        now = _monotonic()
        if now > deadline:
            if on_timeout is not None and on_timeout():
                return
            # "did not complete within" the limit: the limit, not the time measured past
            # it (which on a loaded machine runs over by a poll interval or more).
            raise timeout_error(op, group, seconds, seq=seq, kind=kind, source=source,
                                work=work)
        napping = napping or now >= nap_from
