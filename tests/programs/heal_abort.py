"""An abort under ULFM must end the whole job: every process gone and the launcher
returned non-zero within seconds, whatever state the job is in.

    mpiexec --with-ft ulfm -n 4 python tests/programs/heal_abort.py CASE

CASE:
- ``stopped``: rank 1 stops itself (SIGSTOP: alive to MPI, deaf to everything), then
  rank 0 raises; the stopped process must be ended too.
- ``after_heal``: rank 3 is killed, the survivors heal, then the new process (a job of
  its own to Open MPI) raises.
- ``failed_heal``: rank 3 is killed and every process heal() starts dies before it
  joins; heal's rank 0 gives up and ends the job.

Before the error, the raising process prints ``RAISE {"t": <time.time()>}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import spmd as dist
from spmd.runtime import heal


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


CASE = sys.argv[1]
if CASE == "failed_heal":
    if "SPMD_JOIN_PORT" in os.environ:   # a process heal() started: dies before it joins
        os.kill(os.getpid(), signal.SIGKILL)
    heal.JOIN_SECONDS = 1.0
dist.init_process_group(timeout=timedelta(seconds=3))
rank = dist.get_rank()


def raise_now(what: str) -> None:
    say("RAISE " + json.dumps({"t": time.time(), "rank": rank}))
    raise RuntimeError(what)


if CASE == "stopped":
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(0.5)
    if rank == 0:
        raise_now("rank 0 fails while rank 1 is stopped")
    time.sleep(60)    # the others idle: the abort must end them
elif CASE in ("after_heal", "failed_heal"):
    if dist.is_replacement():
        dist.heal_state(None)
        raise_now("the new process fails after the heal")
    dist.barrier()
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.barrier()
    except dist.ProcessFailedError as err:
        dist.shrink_group(err.group_ranks)
        if CASE == "failed_heal":
            say("RAISE " + json.dumps({"t": time.time(), "rank": rank}))   # heal gives up
        dist.heal()
        dist.heal_state({"step": 1})
    time.sleep(60)    # the survivors idle: the abort must end them
else:
    raise SystemExit(f"unknown case {CASE!r}")
