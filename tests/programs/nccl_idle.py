"""An NCCL job that idles past its groups' timeout, then goes on (as an evaluation phase,
checkpoint writing or data loading makes a training job do).

Every rank: NCCL ops on WORLD and on a subgroup with a short timeout (a blocking
all_reduce, and an async one whose Work is dropped), the GPU synchronised, then longer
than timeout + watchdog grace + interval without collectives, then more ops whose
results are checked.  The watchdog must report nothing and break no group.  Prints
``nccl_idle OK`` on every rank.

    mpiexec -n N python tests/programs/nccl_idle.py [--double] [--idle SECONDS]

``--double`` runs on spmd.testing.device_double (no GPU needed).
"""

import argparse
import sys
import time
from datetime import timedelta

import numpy as np

import spmd as dist
from spmd.runtime import reliability

args = argparse.ArgumentParser()
args.add_argument("--double", action="store_true")
args.add_argument("--idle", type=float, default=4.0)
args = args.parse_args()
if args.double:
    from spmd.testing import device_double

    device_double.install()
import spmd.core.cuda as _gpu  # noqa: E402 - after the double is installed

cp = _gpu.cupy_or_none()
dist.init_process_group(backend="cpu:mpi,cuda:nccl", timeout=timedelta(seconds=1),
                        pg_options={"watchdog_interval": 0.5})
rank, n = dist.get_rank(), dist.get_world_size()
sub = dist.new_group(list(range(0, n, 2)), timeout=timedelta(seconds=1), group_desc="evens")
groups = [dist.GroupMember.WORLD] + ([sub] if rank % 2 == 0 else [])
for g in groups:
    x = cp.full(8, rank + 1.0, cp.float32)
    dist.all_reduce(x, group=g)
    dist.all_reduce(cp.ones(4, cp.float32), group=g, async_op=True)  # Work dropped
cp.cuda.runtime.deviceSynchronize()
dist.barrier(device_ids=[0])  # an NCCL barrier too
time.sleep(args.idle)
for g in groups:
    members = dist.get_process_group_ranks(g)
    x = cp.full(8, rank + 1.0, cp.float32)
    dist.all_reduce(x, group=g)  # raises GroupBrokenError if the watchdog broke the group
    expect = float(sum(r + 1 for r in members))
    np.testing.assert_array_equal(cp.asnumpy(x), np.full(8, expect, np.float32))
stray = [r for r in reliability.reports if "watchdog" in r]
if stray:
    print(f"rank {rank}: the watchdog reported a healthy idle job:\n{stray[0]}", flush=True)
    sys.exit(1)
dist.destroy_process_group()
print(f"rank {rank}: nccl_idle OK (idled {args.idle:g} s past a 1 s timeout)", flush=True)
