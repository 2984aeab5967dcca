"""The last rank dies while the others are inside ``destroy_process_group``: their
teardown (the shared-memory engine's window, whose freeing every rank of the node must
meet) meets the death and must still end, without an error, so that the job finishes.

    mpiexec --with-ft ulfm -n N python tests/programs/ulfm_destroy.py

Each survivor prints ``RESULT {json}``: its rank and the seconds its destroy took.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import time

import numpy as np

import spmd as dist

# A rank still here after 60 s is stuck: print every thread's stack and end it.
faulthandler.dump_traceback_later(60, exit=True)
dist.init_process_group()
rank, size = dist.get_rank(), dist.get_world_size()
x = np.full(2 * 1024 * 1024, rank + 1.0)   # 16 MiB of float64: the shared-memory engine's
dist.all_reduce(x)
assert np.all(x == size * (size + 1) / 2), x[:4]
dist.barrier()
if rank == size - 1:
    time.sleep(0.5)   # the others wait for it inside destroy_process_group
    os.kill(os.getpid(), signal.SIGKILL)
start = time.monotonic()
dist.destroy_process_group()
print("RESULT " + json.dumps({"rank": rank, "destroy_s": round(time.monotonic() - start, 3)}),
      flush=True)
