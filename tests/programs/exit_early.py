"""One rank's program ends (sys.exit) while the others wait in a collective with it, with
the default 30-minute group timeout: the others must hear of it within seconds.

    mpiexec -n N python exit_early.py         (the last rank exits)

Each waiting rank prints "heard: <the error's first line>" and "after S s"; the job must
end by itself.  Under ULFM (mpiexec --with-ft ulfm) the exit is a failed rank: the error
is ProcessFailedError, and the survivors shrink WORLD and go on without it.
"""

import sys
import time

import numpy as np

import spmd

spmd.init_process_group()
rank, n = spmd.get_rank(), spmd.get_world_size()
spmd.all_reduce(np.ones(4))   # every rank is up
if rank == n - 1:
    sys.exit(0)
t0 = time.monotonic()
try:
    spmd.all_reduce(np.ones(4))
except (spmd.GroupBrokenError, spmd.ProcessFailedError) as exc:
    print(f"heard: {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
    print(f"after {time.monotonic() - t0:.2f} s", flush=True)
    if isinstance(exc, spmd.ProcessFailedError):
        world = spmd.shrink_group(exc.group_ranks)
        x = np.ones(2)
        spmd.all_reduce(x, group=world)
        assert (x == n - 1).all(), x
        print("shrunk and went on", flush=True)
else:
    raise AssertionError("the all_reduce completed without the rank that exited")
