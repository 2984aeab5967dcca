"""Rank 1 raises; the others wait in a barrier with the default 30-minute timeout.
spmd's excepthook must abort the whole job within seconds."""
import numpy as np

import spmd

spmd.init_process_group()
rank = spmd.get_rank()
x = np.ones(2)
spmd.all_reduce(x)
print(f"rank {rank} ready", flush=True)
if rank == 1:
    raise ValueError("boom on purpose")
spmd.barrier()  # never completes: rank 1 is gone
print(f"rank {rank} passed the barrier", flush=True)
