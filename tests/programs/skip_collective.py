"""The last rank skips the second all_reduce and sleeps; the others must time out with a
diagnosis naming it (timeout 2 s).  Run: mpiexec -n 3 python skip_collective.py [catch]

With "catch", waiting ranks print the error and how long they waited, then re-raise
(after the others have printed too), so every rank's diagnosis reaches the output;
without it the first DistTimeoutError aborts the job through spmd's excepthook."""
import sys
import time
from datetime import timedelta

import numpy as np
from mpi4py import MPI

import spmd

spmd.init_process_group(timeout=timedelta(seconds=2))
rank, n = spmd.get_rank(), spmd.get_world_size()
waiters = MPI.COMM_WORLD.Split(0 if rank < n - 1 else 1, rank)
x = np.ones(4)
spmd.all_reduce(x)
if rank == n - 1:
    time.sleep(60)  # the straggler: never reaches all_reduce #2
    sys.exit(0)
t0 = time.monotonic()
try:
    spmd.all_reduce(x)
except spmd.DistTimeoutError as exc:
    waited = time.monotonic() - t0
    if "catch" not in sys.argv:
        raise
    print(f"rank {rank} raised {type(exc).__name__} after {waited:.2f} s:\n{exc}", flush=True)
    try:
        spmd.all_reduce(x)
    except spmd.GroupBrokenError as again:
        print(f"rank {rank} then: {type(again).__name__}: {again}", flush=True)
    waiters.Barrier()
    raise
