"""An NCCL op the last rank never joins, on the device double, and the program reads its
output at once: what the other ranks see after the op times out.

A blocking NCCL all_reduce returns once it is enqueued, so the program already holds its
array, and reads it at once: the main thread with ``cp.asnumpy`` (or, with ``--detect
wait``/``next``, through spmd first) and one thread each with ``.get()``, ``.item()``, a
stream synchronize and a device synchronize.  Every such read waits for the op.

``--detect`` says who finds the timeout first: ``watchdog`` (nobody waits on the op),
``wait`` (the rank's own host wait on a Work of the group, at the group's timeout) or
``next`` (a host op on the group times out first, and the next NCCL op raises).

- ``--policy abort`` (the default policy): the job ends with the diagnosis while every
  read still waits: no line ``USED`` or ``RETURNED`` appears.
- ``--policy raise`` (or ``SPMD_DEVICE_TIMEOUT=raise``): the process stays up; every read through spmd (``synchronize``,
  ``wait``, ``is_completed``, the next op) raises, and the raw reads stay blocked until
  the program destroys the group (``READS BLOCKED``); only then do they return
  (``RETURNED after the group was given up``).  The ranks meet on the host and end
  normally, each printing ``nccl_timeout OK``.

    mpiexec -n N python tests/programs/nccl_timeout.py [--policy abort|raise]
                                                       [--detect watchdog|wait|next]
"""

import argparse
import sys
import threading
import time
from datetime import timedelta

from spmd.testing import device_double

device_double.install()

import spmd as dist  # noqa: E402 - after the double is installed
import spmd.core.cuda as _gpu  # noqa: E402
from spmd.runtime import reliability  # noqa: E402

args = argparse.ArgumentParser()
args.add_argument("--policy", choices=("abort", "raise"), default=None)
args.add_argument("--detect", choices=("watchdog", "wait", "next"), default="watchdog")
args = args.parse_args()
options = {"watchdog_interval": 0.2}
if args.policy is not None:
    options["device_timeout"] = args.policy
cp = _gpu.cupy_or_none()
dist.init_process_group(backend="cpu:mpi,cuda:nccl", pg_options=options)
rank, n = dist.get_rank(), dist.get_world_size()
# The NCCL path's first use (its modules, its engine) on WORLD, under WORLD's timeout: the
# 1-s group below then times only its own set-up exchange, not the first use on a
# loaded machine (seen: rank 0 still inside that first all_reduce past 1 s, 4 test
# jobs at once on 2 cores).
dist.all_reduce(cp.ones(1, cp.float32))
g = dist.new_group(list(range(n)), backend="cpu:mpi,cuda:nccl", timeout=timedelta(seconds=1),
                   group_desc="gpu")
dist.all_reduce(cp.ones(1, cp.float32), group=g)   # every rank: the communicator is made
device_double.runtime.deviceSynchronize()
dist.barrier()

given_up = threading.Event()   # set just before the program destroys the group


def say(text: str) -> None:
    sys.stdout.write(f"[rank {rank}] {text}\n")   # one write: the reader threads print too
    sys.stdout.flush()


def reader(kind: str, x) -> threading.Thread:
    """A thread that reads ``x`` the way ``kind`` says, at once."""
    def read():
        say(f"READING {kind}")
        if kind == "get":
            value = x.get()
        elif kind == "item":
            value = x[0].item()
        elif kind == "stream synchronize":
            cp.cuda.get_current_stream().synchronize()
            value = cp.asnumpy(x)
        else:  # device synchronize
            cp.cuda.Device().synchronize()
            value = cp.asnumpy(x)
        when = "after the group was given up" if given_up.is_set() else "BEFORE the give-up"
        say(f"READ {kind} RETURNED {value} {when}")
    t = threading.Thread(target=read, name=f"read-{kind}", daemon=True)
    t.start()
    return t


def spmd_read(what: str, call) -> None:
    try:
        call()
    except dist.DistError as exc:
        say(f"{what} RAISED {type(exc).__name__}: {str(exc).splitlines()[0]}")
    else:
        say(f"USED {what}: it returned")


def watchdog_reported() -> bool:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if any("spmd watchdog: all_reduce #2" in r for r in reliability.reports):
            return True
        time.sleep(0.05)   # waiting for the report, not for a race to settle
    return False


if rank < n - 1:
    x = cp.full(4, rank + 1, cp.float32)
    dist.all_reduce(x, group=g)        # returns when enqueued; the last rank never comes
    readers = [reader(kind, x) for kind in ("get", "item", "stream synchronize",
                                            "device synchronize")]
    work = dist.all_reduce(cp.ones(2, cp.float32), group=g, async_op=True)
    if args.detect == "wait":          # the rank's own wait times out first
        spmd_read("synchronize", work.synchronize)
    elif args.detect == "next":        # a host op on the group times out first
        spmd_read("host barrier", lambda: dist.barrier(group=g))
        spmd_read("next op", lambda: dist.all_reduce(cp.ones(1, cp.float32), group=g))
    if reliability.config().device_timeout != "raise":   # --policy, or SPMD_DEVICE_TIMEOUT
        say(f"USED {cp.asnumpy(x)}")   # blocks: the job ends before this returns
    else:
        if args.detect == "watchdog":
            assert watchdog_reported(), "no watchdog report"
        for what, call in (("synchronize", work.synchronize), ("wait", work.wait),
                           ("is_completed", work.is_completed),
                           ("next op", lambda: dist.all_reduce(cp.ones(1, cp.float32),
                                                               group=g))):
            spmd_read(what, call)
        assert watchdog_reported(), "no watchdog report"   # it finds the blocking op too
        blocked = sum(t.is_alive() for t in readers)
        say(f"READS BLOCKED: {blocked} of {len(readers)}")
        given_up.set()
        dist.destroy_process_group(g)   # lets the op's stream go: its outputs are garbage
        for t in readers:
            t.join(timeout=30)
        say(f"READ asnumpy RETURNED {cp.asnumpy(x)} after the group was given up")
dist.barrier()   # on the host: the last rank waits here (in vain under the default)
say("nccl_timeout OK")
