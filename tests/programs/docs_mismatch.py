"""The debug-mode example of docs/debugging.md: rank 3 passes a longer array."""
import numpy as np

import spmd

spmd.init_process_group()
n = 5 if spmd.get_rank() == 3 else 4
spmd.all_reduce(np.ones(n))
