"""The last rank hangs (stopped, or in an endless Python loop) while the others wait in a
collective: under ULFM the survivors end it, get ProcessFailedError naming it, shrink the
default group and go on with right results; without ULFM they get the diagnosis.

    mpiexec [--with-ft ulfm] -n N python tests/programs/hang_one_rank.py HOW [TIMEOUT]

HOW: stop (SIGSTOP to itself) or loop (an endless loop that still lets its threads run).
Each survivor prints ``RESULT {json}``: the error, its failed ranks, the seconds from the
op's start to the error, and an all_reduce on the shrunk world checked against numpy.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np

import spmd as dist


def say(line: str) -> None:
    """One write per line (the launcher can split a line written in two)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()

HOW = sys.argv[1]
TIMEOUT = float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
faulthandler.dump_traceback_later(60, exit=True)   # a stuck survivor shows where it is
dist.init_process_group(timeout=timedelta(seconds=TIMEOUT))
rank, size = dist.get_rank(), dist.get_world_size()
hung = size - 1
x = np.full(8, rank + 1.0)
dist.all_reduce(x)
assert np.all(x == size * (size + 1) / 2)
dist.barrier()
if rank == hung:
    if HOW == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    while True:   # loop, or woken from a stop by mistake: never reaches the op
        sum(range(1000))
t0 = time.monotonic()
result = {"rank": rank}
try:
    dist.all_reduce(np.ones(8))
except dist.ProcessFailedError as exc:
    result.update(error="ProcessFailedError", failed=list(exc.failed_ranks),
                  seconds=round(time.monotonic() - t0, 2))
    world = dist.shrink_group(list(exc.group_ranks))
    y = np.full(8, float(dist.get_rank() + 1))
    dist.all_reduce(y, group=world)
    n = dist.get_world_size()
    result["shrunk_size"] = n
    result["after"] = bool(np.all(y == n * (n + 1) / 2))
except dist.DistError as exc:   # no ULFM: the diagnosis, then the job ends (abort)
    say("RESULT " + json.dumps({**result, "error": type(exc).__name__,
                                  "text": str(exc).splitlines()[0],
                                  "seconds": round(time.monotonic() - t0, 2)}))
    raise
say("RESULT " + json.dumps(result))
