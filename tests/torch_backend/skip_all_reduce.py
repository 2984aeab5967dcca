"""One rank skips an all_reduce: the others end in spmd's DistTimeoutError naming it."""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group("spmd", timeout=timedelta(seconds=float(sys.argv[1])))
x = torch.ones(4)
dist.all_reduce(x)
if dist.get_rank() == dist.get_world_size() - 1:
    time.sleep(600)  # a straggler: never reaches the next all_reduce
dist.all_reduce(x)
