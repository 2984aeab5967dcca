"""DDP over the "spmd" backend whose gradient all-reduce times out: rank 1 skips the
second backward.  Rank 0's backward must raise (the timeout's diagnosis inside torch's
RuntimeError), neither hang in DDP's reducer nor crash it.

    mpiexec -n 2 python tests/programs/ddp_timeout.py
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("spmd", timeout=datetime.timedelta(seconds=3),
                        pg_options={"abort_on_exception": False})
r = dist.get_rank()
m = torch.nn.Linear(4, 1, dtype=torch.float64)
ddp = DDP(m)
x = torch.ones(2, 4, dtype=torch.float64)
ddp(x).sum().backward()
if r == 1:
    time.sleep(8)   # never joins the second backward's all-reduce
    sys.exit(0)
try:
    ddp(x).sum().backward()
    line = "RESULT no error"
except RuntimeError as exc:
    line = f"RESULT raised {type(exc).__name__}: {str(exc).splitlines()[0]}"
os.write(1, (line + "\n").encode())
os._exit(0)   # the timed-out all-reduce is still pending: no collective shutdown
