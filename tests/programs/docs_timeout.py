"""The timeout example of docs/debugging.md: rank 2 never reaches the second all_reduce."""
import time
from datetime import timedelta

import numpy as np

import spmd

spmd.init_process_group(timeout=timedelta(seconds=5))
x = np.ones(4)
spmd.all_reduce(x)
if spmd.get_rank() == 2:
    time.sleep(600)          # a straggler: never reaches the next all_reduce
spmd.all_reduce(x)
