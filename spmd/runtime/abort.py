"""An exception that escapes to ``sys.excepthook`` on one rank ends the whole job: a
rank-tagged traceback, a flight-recorder dump, then ``MPI_Abort``, so ``mpiexec`` or
``srun`` end instead of the other ranks waiting forever (``SPMD_ABORT_ON_EXCEPTION=0`` or
``pg_options={"abort_on_exception": False}`` turns it off).  The traceback ends at the
program's call into spmd (``spmd.runtime.tracebacks``; ``SPMD_TRACEBACK=full`` shows
spmd's own frames)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time

from spmd.backends.mpi import faults, job
from spmd.backends.nccl import communicator as nccl_communicator
from spmd.core import flight_recorder
from spmd.core.errors import DistTimeoutError
from spmd.core.lines import write_lines
from spmd.runtime import hangs
from spmd.runtime.group import world_state
from spmd.runtime.reliability import state
from spmd.runtime.tracebacks import format_uncaught

__all__ = ["ABORT_GRACE", "abort_job", "after_device_timeout", "aborted_elsewhere",
           "excepthook", "stays_up_after_device_timeout"]

ABORT_GRACE = 0.5  # seconds between an uncaught exception's traceback and MPI_Abort


def excepthook(exc_type, exc, tb) -> None:
    """Uncaught exception: rank-tagged traceback, then abort the whole MPI job."""
    if not state.config.abort_on_exception:
        hook = state.prev_hook or sys.__excepthook__
        if hook is sys.__excepthook__:   # Python's own printing, with spmd's frames left out
            write_lines(format_uncaught(exc_type, exc, tb), sys.stderr)
        else:   # a hook the program installed gets the exception as it is
            hook(exc_type, exc, tb)
        return
    tag = f"[rank {state.rank}] "
    text = format_uncaught(exc_type, exc, tb)
    with contextlib.suppress(Exception):  # a closed stdout must not stop the abort
        sys.stdout.flush()
    write_lines("\n".join(tag + line for line in text.splitlines()), sys.stderr)
    if state.size > 1:
        if state.config.dump_dir and not issubclass(exc_type, DistTimeoutError):  # done already
            try:
                flight_recorder.dump(state.config.dump_dir, f"uncaught {exc_type.__name__}")
            except OSError:
                pass
        abort_job(f"spmd: uncaught {exc_type.__name__}: aborting the MPI job so no rank waits "
                  "forever (SPMD_ABORT_ON_EXCEPTION=0 turns this off)")
    sys.stderr.flush()


def abort_job(text: str) -> None:
    """Print ``text`` (rank-tagged) and end the whole MPI job (``MPI_Abort``); never
    returns."""
    tag = f"[rank {state.rank}] "
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    write_lines("\n".join(tag + line for line in text.splitlines()), sys.stderr)
    sys.stderr.flush()
    # The launcher forwards output through pipes and stops reading them when the abort
    # reaches it: give it a moment to pass the text on first.
    time.sleep(ABORT_GRACE)
    if faults.ulfm():
        _end_world()
        # Not MPI_Abort: in a job started fault tolerant it ends nothing (Open MPI's
        # runtime only tells the others); a process that exits with status 1 makes the
        # launcher's status 1 once every process has gone.
        os._exit(1)
    job.abort(1)
    # MPICH's MPI_Abort returns while the launcher tears the job down: this rank must not
    # go on meanwhile (its program would get the error and run on with it).
    os._exit(1)


def _end_world() -> None:
    """Under ULFM ``MPI_Abort`` ends nothing: Open MPI's runtime keeps a job started fault
    tolerant (and the recoverable jobs healing starts) running after any one process
    aborts, and the launcher waits for the rest, forever for a stopped one.  So spmd ends
    every process of the world itself: the ranks on other nodes are told (each ends its
    node's processes), the ones on this node, and any process the launcher runs here for
    this job (a new one not yet joined), are killed."""
    world = world_state.world
    ch = state.channel
    if world is not None and ch is not None:
        others = [r for r in range(world.context.size) if r != world.context.rank]
        ch.notify(others, {"q": "abort", "from": state.rank, "host": socket.gethostname()})
    job.kill_launched_here(hangs.pids_on_this_node())


def aborted_elsewhere(notice: dict) -> None:
    """A rank on another node aborts the job (runs on the control thread): end this
    node's processes of the world, then this process, with status 1."""
    if notice.get("host") == socket.gethostname():
        return   # the aborting rank ends this node's processes itself
    write_lines(f"[rank {state.rank}] spmd: rank {notice.get('from')} aborts the job; "
                "ending this node's processes", sys.stderr)
    job.kill_launched_here(hangs.pids_on_this_node())
    os._exit(1)   # now, from this thread: no exit handler may wait on MPI


def stays_up_after_device_timeout() -> bool:
    """Whether this process goes on after one of its device ops timed out (the
    device-timeout policy is "raise")."""
    return state.config.device_timeout == "raise"


# The NCCL engine asks this before it lets a timed-out op's stream go (it cannot import
# the runtime): a process that ends never lets it go.
nccl_communicator.set_timeout_policy(stays_up_after_device_timeout)


def after_device_timeout(engine: str, op: str, seq: int | None,
                         diagnosis: str | None = None, stays_up: bool | None = None) -> None:
    """An op on ``engine`` timed out (found by the watchdog or by a waiting rank).  On an
    engine whose blocking calls return before the op completes (NCCL), the program may
    already hold the op's outputs and be reading them (``asnumpy``, ``.item()``, a
    synchronize); those reads wait for the op's stream, which spmd leaves blocked (the
    communicator is held, not aborted).  By default the job ends here, after the
    diagnosis, with the stream still blocked: nothing the op wrote reaches the program,
    not even during ``ABORT_GRACE``; the device is let go only as the process goes.

    With ``SPMD_DEVICE_TIMEOUT=raise`` the process stays up: the op's Work, the group's
    next op and its next wait raise, and the stream stays blocked until the program
    destroys the group (``destroy_process_group`` then aborts the NCCL communicator,
    and the op's outputs hold whatever it had written).  A read that bypasses spmd
    cannot be made to raise on CUDA: it waits until then.

    ``diagnosis``: the timeout's text where nobody has printed it yet (a waiting rank's,
    which would otherwise only be raised).  ``stays_up``: the policy as the caller read
    it when it told the program what follows (None: read it here)."""
    if stays_up is None:
        stays_up = stays_up_after_device_timeout()
    if engine != flight_recorder.NCCL_ENGINE or stays_up:
        return
    text = "" if diagnosis is None else diagnosis + "\n"
    abort_job(text + f"spmd: {op} #{seq} timed out on the GPU ({engine}); its outputs are not "
              "results, so the job ends here, with its stream still blocked so that no read "
              "of them returns (SPMD_DEVICE_TIMEOUT=raise, or pg_options={'device_timeout': "
              "'raise'}, keeps this process up: the op's Work and the group's next op then "
              "raise)")
