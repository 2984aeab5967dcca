"""An NCCL op the last rank never joins, on the device double: what the others see after
the watchdog times it out.

A blocking NCCL all_reduce returns once it is enqueued, so the program already holds its
array when the op times out.  With the default device-timeout policy ("abort") the job
ends after the watchdog's diagnosis, before any rank can use that array: the line
``USED`` never appears.  With ``--policy raise`` the process stays up: the op's Work
and the group's next op raise, the ranks meet on the host and end normally, each
printing ``nccl_timeout OK``.

    mpiexec -n N python tests/programs/nccl_timeout.py [--policy abort|raise]
"""

import argparse
import time
from datetime import timedelta

from spmd.testing import device_double

device_double.install()

import spmd as dist  # noqa: E402 - after the double is installed
import spmd.core.cuda as _gpu  # noqa: E402
from spmd.runtime import reliability  # noqa: E402

args = argparse.ArgumentParser()
args.add_argument("--policy", choices=("abort", "raise"), default=None)
args = args.parse_args()
options = {"watchdog_interval": 0.2}
if args.policy is not None:
    options["device_timeout"] = args.policy
cp = _gpu.cupy_or_none()
dist.init_process_group(backend="cpu:mpi,cuda:nccl", pg_options=options)
rank, n = dist.get_rank(), dist.get_world_size()
g = dist.new_group(list(range(n)), backend="cpu:mpi,cuda:nccl", timeout=timedelta(seconds=1),
                   group_desc="gpu")
dist.all_reduce(cp.ones(1, cp.float32), group=g)   # every rank: the communicator is made
device_double.runtime.deviceSynchronize()
dist.barrier()

if rank < n - 1:
    x = cp.full(4, rank + 1, cp.float32)
    dist.all_reduce(x, group=g)        # returns when enqueued; the last rank never comes
    work = dist.all_reduce(cp.ones(2, cp.float32), group=g, async_op=True)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not any("spmd watchdog" in r for r in
                                                  reliability.reports):
        time.sleep(0.05)
    assert any("spmd watchdog" in r for r in reliability.reports), "no watchdog report"
    time.sleep(2.0)   # the default policy ends the job here, from the watchdog's thread
    try:
        work.wait()
    except dist.DistError as exc:
        print(f"[rank {rank}] WORK RAISED {type(exc).__name__}: {exc}".splitlines()[0],
              flush=True)
    else:
        print(f"[rank {rank}] USED {cp.asnumpy(x)}", flush=True)
    try:
        dist.all_reduce(cp.ones(1, cp.float32), group=g)
    except dist.GroupBrokenError:
        print(f"[rank {rank}] NEXT OP RAISED GroupBrokenError", flush=True)
    else:
        print(f"[rank {rank}] USED the group after its timeout", flush=True)
dist.barrier()   # on the host: the last rank waits here (in vain under the default)
print(f"[rank {rank}] nccl_timeout OK", flush=True)
