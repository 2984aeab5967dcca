"""Rank 1 kills itself with SIGKILL while the others wait in a barrier (default
timeout); the launcher must end the job, leaving no rank behind."""
import os
import signal
import time

import numpy as np

import spmd

spmd.init_process_group()
rank = spmd.get_rank()
spmd.all_reduce(np.ones(1))
print(f"rank {rank} pid {os.getpid()}", flush=True)
spmd.barrier()
if rank == 1:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
spmd.barrier()
print(f"rank {rank} passed the barrier", flush=True)
