"""Soak: 20,000 mixed blocking and async operations over several groups (3+ ranks).

Checks at the end, on every rank: resident memory grew by less than RSS_BOUND between
the end of the warm-up (which fills the flight recorder's ring) and the end; no Work
object is alive; no MPI request is pending; the groups and communicators made and
destroyed along the way are all gone.  Prints "rank R soak OK ..." on success."""
import gc
import os
import sys
import time
import weakref
from datetime import timedelta

import numpy as np
from mpi4py import MPI

import spmd
from spmd.core import work as _work
from spmd.runtime.group import world_state

OPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20000   # at least this many per rank
WARMUP = 4000
RSS_BOUND = 2**20   # bytes


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Tracker:
    """Sees every Work: lets the end check that none is left alive."""

    def __init__(self):
        self.live = weakref.WeakSet()
        self.count = 0

    def started(self, work):
        self.live.add(work)
        self.count += 1

    def completed(self, work):
        pass


def live_requests() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, MPI.Request) and o != MPI.REQUEST_NULL)


def live_comms() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, MPI.Comm) and o != MPI.COMM_NULL)


spmd.init_process_group(timeout=timedelta(seconds=60))
rank, n = spmd.get_rank(), spmd.get_world_size()
assert n >= 3, "run with 3 or more ranks"
tracker = Tracker()
_work.add_observer(tracker)
world = spmd.runtime.group.WORLD
pair = spmd.new_group([0, 1])                 # rank 2.. are not members
halves = spmd.split_group(split_ranks=[list(range(0, n, 2)), list(range(1, n, 2))])
dup = spmd.new_group(list(range(n)), group_desc="dup")
groups = [world, pair, halves, dup]      # the same list on every rank; pair may be a non-member
base_groups = len(world_state.groups)
gc.collect()
base_comms = live_comms()

x = np.zeros(16)
gathered = {id(g): np.empty(16 * g.size()) for g in groups if g}
done = 0
pending = []
t0 = time.monotonic()
rss_warm = None
step = 0
steps = OPS * 4 // 3 + 100   # ranks outside pair skip a quarter of the steps
while step < steps:
    g = groups[step % len(groups)]
    kind = step % 9
    step += 1
    if not g:
        continue
    if kind == 0:
        spmd.all_reduce(x, group=g)
    elif kind == 1:
        pending.append(spmd.all_reduce(np.ones(8), group=g, async_op=True))
    elif kind == 2:
        spmd.broadcast(x, group_src=0, group=g)
    elif kind == 3:
        spmd.all_gather_into_tensor(gathered[id(g)], np.full(16, rank, float), group=g)
    elif kind == 4:
        pending.append(spmd.barrier(group=g, async_op=True))
    elif kind == 5:
        out = np.empty(4 * g.size(), np.int32)
        spmd.all_to_all_single(out, np.arange(4 * g.size(), dtype=np.int32), group=g)
    elif kind == 6:
        me, size = g.rank(), g.size()
        if size > 1:
            right, left = g.ranks[(me + 1) % size], g.ranks[(me - 1) % size]
            buf = np.empty(8)
            pending.append(spmd.isend(np.full(8, float(rank)), dst=right, group=g))
            pending.append(spmd.irecv(buf, src=left, group=g))
            done += 1
    elif kind == 7:
        out = np.empty(4)
        spmd.reduce_scatter_tensor(out, np.ones(4 * g.size()), group=g)
    else:
        objs = [None] * g.size()
        spmd.all_gather_object(objs, {"r": rank}, group=g)
    done += 1
    if len(pending) > 16:
        for w in pending:
            w.wait()
        pending.clear()
    if step % 2000 == 0:  # groups (communicators) made and destroyed along the way
        tmp = spmd.new_group(list(range(n)), group_desc="tmp")
        spmd.all_reduce(np.ones(1), group=tmp)
        spmd.destroy_process_group(tmp)
    if rss_warm is None and done >= WARMUP:
        for w in pending:
            w.wait()
        pending.clear()
        gc.collect()
        rss_warm = rss()
for w in pending:
    w.wait()
pending.clear()
spmd.barrier()
elapsed = time.monotonic() - t0
del w
gc.collect()
growth = rss() - rss_warm
problems = []
if growth > RSS_BOUND:
    problems.append(f"resident memory grew by {growth / 2**20:.2f} MiB after the warm-up")
if len(tracker.live):
    problems.append(f"{len(tracker.live)} Work objects still alive")
if live_requests():
    problems.append(f"{live_requests()} MPI requests still pending")
if len(world_state.groups) != base_groups:
    problems.append(f"{len(world_state.groups) - base_groups} groups leaked")
if live_comms() != base_comms:
    problems.append(f"communicators: {live_comms()} alive, {base_comms} at the start")
if spmd.core.flight_recorder.recorder.in_flight():
    problems.append(f"{len(spmd.core.flight_recorder.recorder.in_flight())} ops still in flight")
if problems:
    print(f"rank {rank} soak FAILED: " + "; ".join(problems), flush=True)
    sys.exit(1)
print(f"rank {rank} soak OK: {done} ops ({tracker.count} Works) in {elapsed:.1f} s, "
      f"RSS growth after warm-up {growth / 2**10:.0f} KiB (bound {RSS_BOUND // 2**20} MiB)",
      flush=True)
for g in (pair, halves, dup):
    if g:
        spmd.destroy_process_group(g)
spmd.destroy_process_group()
