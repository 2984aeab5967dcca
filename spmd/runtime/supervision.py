"""Timeouts that end in a diagnosis, the watchdog and its heartbeat, aborting the job:
what ``init_process_group`` starts and ``destroy_process_group`` stops.

Started by ``init_process_group`` and stopped by ``destroy_process_group``:

- a **timeout** (a wait past its deadline) asks the other ranks of the group, over the
  control channel, where they are, and raises ``DistTimeoutError`` saying the op, the
  group, its sequence number, how long it waited, which ranks have not reached it and
  what they do instead.  A timed-out collective leaves the group's ranks out of step,
  so the group is marked broken: later calls on it raise ``GroupBrokenError`` at once.
- the **watchdog** thread checks in-flight operations against the group's timeout even
  when nobody waits on them, and reports them the same way; the control thread watches
  the watchdog's **heartbeat** and reports a watchdog that is itself stuck.
- an exception that escapes to ``sys.excepthook`` prints a rank-tagged traceback and
  **aborts the MPI job**, so ``mpiexec``/``srun`` end instead of the other ranks waiting
  forever (``SPMD_ABORT_ON_EXCEPTION=0`` or ``pg_options={"abort_on_exception": False}``
  turns it off).

Settings come from ``init_process_group(pg_options={...})``, else from the environment
(``SPMD_DEBUG``, ``SPMD_ABORT_ON_EXCEPTION``, ``SPMD_DUMP_DIR``,
``SPMD_FLIGHT_RECORDER_SIZE``, ``SPMD_WATCHDOG``, ``SPMD_WATCHDOG_INTERVAL``,
``SPMD_HEARTBEAT_TIMEOUT``, ``SPMD_QUERY_TIMEOUT``), else from the defaults of Config.
"""

from __future__ import annotations

import atexit
import dataclasses
import sys

from spmd.backends.mpi import faults
from spmd.backends.mpi.control import Channel
from spmd.backends.setup import run_blocking
from spmd.core import flight_recorder
from spmd.core import wait as _wait
from spmd.core import work as _work
from spmd.core.context import set_broken_notice
from spmd.core.lines import write_lines
from spmd.runtime import debug, exits, failures, hangs
from spmd.runtime.abort import excepthook
from spmd.runtime.diagnosis import (
    RECOVERY,
    RECOVERY_PATIENCE,
    answer,
    diagnose_timeout,
    tell_broken,
)
from spmd.runtime.group import ProcessGroup, world_state
from spmd.runtime.reliability import Config, config, reports, state
from spmd.runtime.watchdog import Watchdog, heartbeat_check

__all__ = ["Config", "config", "reports", "start", "stop"]

_atexit_registered = False


def start(world: ProcessGroup, cfg: Config, op: str = "init_process_group") -> None:
    """Called by init_process_group on every rank, after WORLD exists (and by ``op``,
    shrink_group or heal, on every rank of the world it makes).

    Raises:
        ProcessFailedError: a member died during its collective steps (under ULFM: the
            survivors agreed on it; the program shrinks again).
    """
    global _atexit_registered
    state.config = cfg
    state.rank, state.size = world.context.rank, world.context.size
    if cfg.flight_recorder_size > 0:
        if flight_recorder.recorder.size != flight_recorder.ring_size(cfg.flight_recorder_size):
            flight_recorder.recorder.resize(cfg.flight_recorder_size)
        _work.add_observer(flight_recorder.recorder)
    else:  # off: no per-call cost, and no sequence numbers in diagnoses
        _work.remove_observer(flight_recorder.recorder)
    _wait.set_diagnosis(diagnose_timeout)
    set_broken_notice(tell_broken)
    failures.install()
    flight_recorder.recorder.groups_source = lambda: (
        world_state.world.context if world_state.world is not None else None,
        [pg.context for pg in list(world_state.groups)])
    flight_recorder.recorder.dump_dir = cfg.dump_dir
    debug.set_debug_level(cfg.debug)
    if sys.excepthook is not excepthook:
        state.prev_hook = sys.excepthook
        sys.excepthook = excepthook
    if not _atexit_registered:
        # Runs before mpi4py's MPI_Finalize (registered earlier): threads must not be in
        # an MPI call when MPI goes away.
        atexit.register(stop)
        # Runs first (atexit is last in, first out): the peers hear of the exit while
        # the control channel is still up.
        atexit.register(exits.announce)
        _atexit_registered = True
    # The collective steps last: where a member of a shrunk or healed world dies during
    # them, the failure they raise leaves the rest of the start done.
    def collective_steps() -> None:
        hangs.learn_peers(world.context.comm)
        state.channel = Channel(world.context.comm, answer, heartbeat_check)

    try:
        if op == "init_process_group":
            collective_steps()
        else:
            # A world that shrink_group or heal makes: a member that hangs here (no
            # control channel runs yet) is found by the group's timeout, stopped on this
            # node (spmd.runtime.diagnosis), and ended, as in any recovery step.
            run_blocking(world.context, op, "starting the new world", collective_steps,
                         world.context.timeout, kind=RECOVERY, patience=RECOVERY_PATIENCE)
    except Exception as exc:
        error = faults.failure(exc, op, world.context)
        if error is exc:   # not MPI's report of a member's death
            raise
        raise error from exc
    if cfg.watchdog:
        state.watchdog = Watchdog(cfg.watchdog_interval)
    if cfg.debug != "OFF" and world.context.rank == 0:
        write_lines(f"[rank 0] spmd reliability settings: {dataclasses.asdict(cfg)}; MPI thread "
                    f"level {'multiple' if faults.threads_may_call() else 'below multiple'}",
                    sys.stderr)


def stop() -> None:
    """Called by destroy_process_group (and at exit): stop the threads, free the channel."""
    if state.watchdog is not None:
        state.watchdog.close()
        state.watchdog = None
    set_broken_notice(None)
    if state.channel is not None:
        state.channel.close()
        state.channel = None
    if sys.excepthook is excepthook:
        sys.excepthook = state.prev_hook or sys.__excepthook__
    state.prev_hook = None
