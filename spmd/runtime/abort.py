"""An exception that escapes to ``sys.excepthook`` on one rank ends the whole job: a
rank-tagged traceback, a flight-recorder dump, then ``MPI_Abort``, so ``mpiexec`` or
``srun`` end instead of the other ranks waiting forever (``SPMD_ABORT_ON_EXCEPTION=0`` or
``pg_options={"abort_on_exception": False}`` turns it off)."""

from __future__ import annotations

import contextlib
import sys
import time
import traceback

from mpi4py import MPI

from spmd.core import flight_recorder
from spmd.core.errors import DistTimeoutError
from spmd.core.lines import write_lines
from spmd.runtime.reliability import state

__all__ = ["ABORT_GRACE", "excepthook"]

ABORT_GRACE = 0.5  # seconds between an uncaught exception's traceback and MPI_Abort


def excepthook(exc_type, exc, tb) -> None:
    """Uncaught exception: rank-tagged traceback, then abort the whole MPI job."""
    if not state.config.abort_on_exception:
        (state.prev_hook or sys.__excepthook__)(exc_type, exc, tb)
        return
    tag = f"[rank {state.rank}] "
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    with contextlib.suppress(Exception):  # a closed stdout must not stop the abort
        sys.stdout.flush()
    write_lines("\n".join(tag + line for line in text.splitlines()), sys.stderr)
    if state.size > 1:
        if state.config.dump_dir and not issubclass(exc_type, DistTimeoutError):  # done already
            try:
                flight_recorder.dump(state.config.dump_dir, f"uncaught {exc_type.__name__}")
            except OSError:
                pass
        sys.stderr.write(f"{tag}spmd: uncaught {exc_type.__name__}: aborting the MPI job so no "
                         "rank waits forever (SPMD_ABORT_ON_EXCEPTION=0 turns this off)\n")
        sys.stderr.flush()
        # The launcher forwards output through pipes and stops reading them when the
        # abort reaches it: give it a moment to pass the traceback on first.
        time.sleep(ABORT_GRACE)
        MPI.COMM_WORLD.Abort(1)
    sys.stderr.flush()
