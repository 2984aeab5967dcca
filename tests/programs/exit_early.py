"""One rank's program ends (sys.exit) while the others wait in a collective with it, with
the default 30-minute group timeout: the others must hear of it within seconds.

    mpiexec -n N python exit_early.py         (the last rank exits)

Each waiting rank prints "heard: <the error's first line>" and "after S s", then shrinks
WORLD without the exited rank (only the others call it), reduces on the new world and
prints "shrunk and went on"; the job must end by itself, on every MPI.  Under ULFM the
exited rank is a failed rank (ProcessFailedError), shrunk out the same way.
"""

import sys
import time

import numpy as np

import spmd


def say(line: str) -> None:
    """One write per line: the launcher forwards each rank's output in chunks, and a
    line written in two (print's text, then its newline) can be split by another's."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


spmd.init_process_group()
rank, n = spmd.get_rank(), spmd.get_world_size()
spmd.all_reduce(np.ones(4))   # every rank is up
if rank == n - 1:
    sys.exit(0)
t0 = time.monotonic()
try:
    spmd.all_reduce(np.ones(4))
except (spmd.GroupBrokenError, spmd.ProcessFailedError) as exc:
    # Under ULFM the exited rank leaves without MPI_Finalize: a failed rank, whose
    # failure may be met before its notice.
    say(f"heard: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    say(f"after {time.monotonic() - t0:.2f} s")
    world = spmd.shrink_group([n - 1])
    x = np.ones(2)
    spmd.all_reduce(x, group=world)
    assert (x == n - 1).all(), x
    say("shrunk and went on")
else:
    raise AssertionError("the all_reduce completed without the rank that exited")
