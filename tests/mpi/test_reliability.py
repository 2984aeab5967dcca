"""Reliability inside one job: sequence numbers and the flight recorder, timeouts that
name the missing rank and break the group, the watchdog and its heartbeat, debug-mode
mismatch checks, monitored_barrier, and ops from two threads.

Runs on every rank at every world size; checks that need a peer skip at size 1.  Jobs
that must die (uncaught exceptions, SIGKILL) are in test_reliability_jobs.py.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
from _late_outcomes import check_waiting_rank, some_rank_diagnosed
from conftest import TEST_TIMEOUT

pytestmark = pytest.mark.mpi

SLACK = 4.0  # seconds a diagnosis may take beyond the timeout on a loaded machine


def _needs_peers(dist, count=2):
    if dist.get_world_size() < count:
        pytest.skip(f"needs {count} ranks")


# ----------------------------------------------------------------------------- recorder

def test_sequence_numbers_and_flight_recorder(dist, fresh):
    from spmd.core import flight_recorder as fr

    n, me = dist.get_world_size(), dist.get_rank()
    g = fresh()
    x = np.ones(3, np.float32)
    dist.all_reduce(x, group=g)
    dist.broadcast(x, src=0, group=g)
    dist.barrier(group=g, async_op=True).wait()
    if n > 1:  # point-to-point ops are numbered on their own
        works = [dist.isend(np.ones(2), dst=(me + 1) % n, group=g),
                 dist.irecv(np.empty(2), src=(me - 1) % n, group=g)]
        for w in works:
            w.wait()
    coll, p2p = fr.counters(g.context)
    assert coll == 3 and p2p == (2 if n > 1 else 0)
    mine = [e for e in fr.recorder.entries() if e.group is g.context]
    coll = [(e.op, e.seq) for e in mine if e.kind == "collective"]
    assert coll == [("all_reduce", 1), ("broadcast", 2), ("barrier", 3)]
    first = mine[0]
    assert first.size == 3 and first.dtype == np.float32
    assert all(e.state() == "completed" and e.t1 >= e.t0 for e in mine)
    snap = json.loads(json.dumps(fr.recorder.snapshot("test")))
    assert snap["rank"] == me and snap["world_size"] == n
    assert any(e["op"] == "barrier" and e["seq"] == 3 and e["group"] == g.name
               for e in snap["entries"])


def test_dump_is_a_private_file(dist, tmp_path):
    me = dist.get_rank()
    path = tmp_path / f"spmd_fr.rank{me}.json"
    path.write_text("{}")
    os.chmod(path, 0o644)  # an existing file gets its mode tightened too
    dist.all_reduce(np.ones(1))
    written = dist.dump_flight_recorder(str(tmp_path))
    assert written == str(path)
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o600
    data = json.loads(path.read_text())
    assert data["format"] == "spmd-flight-recorder" and data["rank"] == me
    assert data["entries"] and data["entries"][-1]["op"] == "all_reduce"


def test_dump_to_stderr_without_a_directory(dist, capsys, monkeypatch):
    from spmd.runtime import reliability

    monkeypatch.setattr(reliability.config(), "dump_dir", None)
    dist.all_reduce(np.ones(2))
    assert dist.dump_flight_recorder() is None
    err = capsys.readouterr().err
    assert f"[rank {dist.get_rank()}] flight recorder (on demand)" in err
    assert "all_reduce #" in err


# ----------------------------------------------------------------------------- timeouts

def test_timeout_names_the_missing_rank_and_breaks_the_group(dist, fresh):
    _needs_peers(dist)
    n, me = dist.get_world_size(), dist.get_rank()
    late = n - 1
    g = fresh(timeout=timedelta(seconds=1))
    x = np.ones(2)
    dist.all_reduce(x, group=g)
    # Outcomes are collected first and checked after every rank has met again below, so
    # that a failed check fails this test and cannot leave the others in a barrier.
    if me != late:
        work = dist.all_reduce(x, group=g, async_op=True)
        t0 = time.monotonic()
        try:
            work.wait()
            timed_out = None
        except Exception as exc:  # noqa: BLE001 - checked below
            timed_out = exc
        waited = time.monotonic() - t0
        t0 = time.monotonic()
        try:
            dist.all_reduce(x, group=g)
            broken = None
        except Exception as exc:  # noqa: BLE001 - checked below
            broken = exc
        refused_in = time.monotonic() - t0
        dist.barrier()
        # The op was given up: its Work keeps its error (its request is held until MPI
        # is done with it; nothing more lands in x).
        with pytest.raises((dist.DistTimeoutError, dist.GroupBrokenError)):
            work.wait()
        own = check_waiting_rank(dist, timed_out, late)
    else:
        dist.barrier()  # the straggler: it is here while the others time out
        # Told that the others gave the op up, its late call raises instead of
        # completing against them.
        with pytest.raises(dist.GroupBrokenError, match=r"timed out on rank \d+ .*\(told by "
                           r"rank \d+\)"):
            dist.all_reduce(x, group=g)
        own = False
    some_rank_diagnosed(dist, own)
    if me == late:
        return
    # the diagnosis may wait for the other ranks' answers (query timeout) on top
    assert 1.0 <= waited < 1.0 + SLACK, waited
    if own:
        text = str(timed_out)
        assert "all_reduce: did not complete within 1.0 s (collective #2 on group" in text
        assert "ranks that have not reached all_reduce #2:" in text
        assert f"rank {late}: last finished all_reduce #1" in text
        assert "test_reliability.py" in text and "dist.barrier()" in text, text  # where
    assert isinstance(broken, dist.GroupBrokenError), repr(broken)
    assert "is broken since all_reduce #2 timed out" in str(broken)
    assert refused_in < 0.5, refused_in


def test_p2p_timeout_leaves_the_group_usable(dist):
    pg = dist.GroupMember.WORLD
    buf = np.zeros(1)
    work = dist.irecv(buf, tag=4243)
    with pytest.raises(dist.DistTimeoutError, match=r"point-to-point op #\d+ on group WORLD"):
        work.wait(timeout=0.2)
    assert pg.context.error is None
    pg.comm.Send(np.array([5.0]), dest=pg.rank(), tag=4243)
    work.wait()
    assert buf[0] == 5.0


def test_timeouts_are_taken_from_group_and_init(dist, fresh):
    from spmd.core.timeouts import DEFAULT_PG_TIMEOUT as DEFAULT_TIMEOUT

    assert DEFAULT_TIMEOUT == timedelta(minutes=30)
    assert dist.GroupMember.WORLD.timeout == TEST_TIMEOUT
    assert fresh(timeout=timedelta(seconds=7)).timeout == timedelta(seconds=7)
    assert fresh().timeout == TEST_TIMEOUT  # new groups inherit the default group's


def test_watchdog_reports_work_nobody_waits_for(dist, fresh):
    from spmd.runtime import reliability

    _needs_peers(dist)
    me = dist.get_rank()
    g = fresh(timeout=timedelta(seconds=1))
    # Every rank first: with SPMD_SHM=force the first op on a group sets the engine up.
    dist.all_reduce(np.ones(1), group=g)
    seen = len(reliability.reports)
    if me == 0:
        work = dist.all_reduce(np.ones(1), group=g, async_op=True)
        deadline = time.monotonic() + 10
        found = []
        while not found and time.monotonic() < deadline:
            found = [r for r in list(reliability.reports)[seen:] if "nobody waits" in r]
            time.sleep(0.05)
        dist.barrier()
        # The group broke under the Work: waiting for it gives it up and raises.
        with pytest.raises(dist.GroupBrokenError):
            work.wait()
        assert found, "the watchdog did not report the stuck all_reduce"
        text = found[0]
        assert "spmd watchdog: all_reduce #2 on group" in text
        assert "ranks that have not reached all_reduce #2:" in text
        assert "in flight on group WORLD: barrier" in text  # where the others are
        assert g.context.error is not None
    else:
        dist.barrier()
        # Told by rank 0's watchdog, the late all_reduce raises instead of completing.
        with pytest.raises(dist.GroupBrokenError, match=r"\(told by rank 0\)"):
            dist.all_reduce(np.ones(1), group=g)


def test_heartbeat_monitor_reports_a_stuck_watchdog(dist, monkeypatch):
    from spmd.runtime import reliability

    wd = reliability.state.watchdog
    assert wd is not None and wd.thread.is_alive()
    monkeypatch.setattr(reliability.config(), "heartbeat_timeout", 0.5)
    seen = len(reliability.reports)
    release = threading.Event()

    def stuck_in_check():
        release.wait(10)

    monkeypatch.setattr(wd, "check", stuck_in_check)
    deadline = time.monotonic() + 8
    found = []
    # A report of the thread in its own sleep can come first when other processes keep
    # it off the CPU for over heartbeat_timeout: true, but not the stall made here.
    while not found and time.monotonic() < deadline:
        found = [r for r in list(reliability.reports)[seen:]
                 if "heartbeat monitor" in r and "stuck_in_check" in r]
        time.sleep(0.05)
    release.set()
    assert found, ("the heartbeat monitor did not report the watchdog stuck in "
                   f"stuck_in_check: {list(reliability.reports)[seen:]}")
    assert "has not beaten for" in found[0]


# ----------------------------------------------------------------------------- debug mode

MISMATCHES = {
    # name: (call on most ranks, call on the last rank, field named in the error)
    "shape": (lambda d: d.all_reduce(np.ones(3)), lambda d: d.all_reduce(np.ones(4)), "shape"),
    "dtype": (lambda d: d.all_reduce(np.ones(3)),
              lambda d: d.all_reduce(np.ones(3, np.float32)), "dtype"),
    "op": (lambda d: d.all_reduce(np.ones(3)), lambda d: d.broadcast(np.ones(3), src=0), "op"),
    "root": (lambda d: d.broadcast(np.ones(3), src=0), lambda d: d.broadcast(np.ones(3), src=1),
             "root"),
    "reduce_op": (lambda d: d.all_reduce(np.ones(3)),
                  lambda d: d.all_reduce(np.ones(3), op=d.ReduceOp.MAX), "reduce_op"),
    "gather_root": (lambda d: d.gather(np.ones(2), _gl(d, 0), dst=0),
                    lambda d: d.gather(np.ones(2), _gl(d, 1), dst=1), "root"),
    "split_sizes": (lambda d: _a2a(d, False), lambda d: _a2a(d, True), "sizes"),
}


def _gl(d, dst):
    return [np.empty(2) for _ in range(d.get_world_size())] if d.get_rank() == dst else None


def _a2a(d, skewed):
    """all_to_all_single where the last rank claims to send one row more to rank 0."""
    n = d.get_world_size()
    split = [1] * n
    out_split = [1] * n
    if skewed:
        split = [2] + [1] * (n - 2) + [0]
        out_split = [1] * (n - 1) + [0]
    d.all_to_all_single(np.empty(sum(out_split)), np.ones(sum(split)),
                        output_split_sizes=out_split, input_split_sizes=split)


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_debug_mode_catches_mismatched_calls_on_every_rank(dist, fresh, detail, case):
    _needs_peers(dist)
    n, me = dist.get_world_size(), dist.get_rank()
    g = fresh(group_desc=f"dbg_{case}")
    most, last, field = MISMATCHES[case]
    from spmd.api import collectives

    class OnGroup:  # the same calls, on group g
        def __getattr__(self, name):
            fn = getattr(dist, name)
            if name in collectives.__all__:
                return lambda *a, **kw: fn(*a, group=g, **kw)
            return fn

    d = OnGroup()
    with pytest.raises(dist.CollectiveMismatchError) as info:
        (last if me == n - 1 else most)(d)
    text = str(info.value)
    assert f"ranks of group dbg_{case} called collective #1 with different arguments" in text
    assert f"{field}" in text
    assert f"rank {n - 1}" in text or f"ranks {n - 1}" in text or "sends" in text
    assert "called from:" in text and "test_reliability.py" in text
    x = np.ones(2)
    dist.all_reduce(x, group=g)  # the group is still in step
    assert x[0] == n


def test_debug_mode_lets_matching_calls_through(dist, fresh, detail):
    n, me = dist.get_world_size(), dist.get_rank()
    g = fresh()
    x = np.full(3, float(me))
    dist.all_reduce(x, group=g)
    assert (x == n * (n - 1) / 2).all()
    out = [np.empty(k + 1) for k in range(n)]  # uneven sizes are legal for all_gather
    dist.all_gather(out, np.full(me + 1, float(me)), group=g)
    assert all((o == k).all() for k, o in enumerate(out))
    big = np.empty(2 * n)
    dist.all_gather_into_tensor(big, np.full(2, float(me)), group=g)
    y = np.empty(2)
    dist.reduce_scatter_tensor(y, np.ones(2 * n), group=g)
    assert (y == n).all()
    splits = [me + 1] * n                        # rank me sends me+1 rows to everyone
    recv = [r + 1 for r in range(n)]
    a2a = np.empty(sum(recv))
    dist.all_to_all_single(a2a, np.full(sum(splits), float(me)), recv, splits, group=g)
    assert (a2a == np.repeat(np.arange(n, dtype=float), recv)).all()
    dist.barrier(group=g)
    assert type(g.engines["cpu"]).__name__ == "CheckedEngine"


# ----------------------------------------------------------------------------- monitored barrier

def test_monitored_barrier_passes_when_everyone_arrives(dist):
    dist.monitored_barrier()
    dist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)


@pytest.mark.parametrize("wait_all", [False, True])
def test_monitored_barrier_names_the_ranks_that_did_not_arrive(dist, fresh, wait_all):
    _needs_peers(dist, 3 if wait_all else 2)
    n, me = dist.get_world_size(), dist.get_rank()
    g = fresh()
    late = list(range(n - 2, n)) if wait_all else [n - 1]
    if me in late:
        time.sleep(1.5)  # arrives after rank 0 gave up: gets its verdict at once
    t0 = time.monotonic()
    try:
        dist.monitored_barrier(group=g, timeout=0.5, wait_all_ranks=wait_all)
        err = None
    except Exception as exc:  # noqa: BLE001 - checked below, after every rank is in step
        err = exc
    took = time.monotonic() - t0
    dist.monitored_barrier(group=g)  # every rank is in step again, whatever happened
    assert isinstance(err, dist.DistTimeoutError), repr(err)
    text = str(err)
    named = "rank " + (f"{late[0]}, rank {late[1]}" if wait_all else f"{late[0]}")
    assert f"monitored_barrier: {named} did not arrive within 0.5 s" in text
    assert "test_reliability.py" in text or me != 0  # rank 0 says where they are
    if me not in late:
        assert took < 0.5 + SLACK


# ----------------------------------------------------------------------------- threads

def test_two_threads_on_two_groups(dist, fresh):
    n = dist.get_world_size()
    groups = [fresh(), fresh()]
    errors = []

    def worker(g, value):
        try:
            for i in range(300):
                x = np.full(4, value + i, np.int64)
                if i % 3:
                    dist.all_reduce(x, group=g)
                else:
                    dist.all_reduce(x, group=g, async_op=True).wait()
                assert (x == n * (value + i)).all(), (x, value, i)
                if i % 50 == 0:
                    dist.barrier(group=g)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(g, 1000 * k)) for k, g in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    from spmd.core.flight_recorder import counters

    assert [counters(g.context)[0] for g in groups] == [306, 306]


# ----------------------------------------------------------------------------- settings

def test_settings_from_options_and_environment(dist, monkeypatch):
    from spmd.core import settings
    from spmd.runtime import abort

    assert sys.excepthook is abort.excepthook  # installed by init
    monkeypatch.setenv("SPMD_ABORT_ON_EXCEPTION", "0")
    monkeypatch.setenv("SPMD_QUERY_TIMEOUT", "1.5")
    cfg = settings.parse_options(None)
    assert cfg.abort_on_exception is False and cfg.query_timeout == 1.5
    cfg = settings.parse_options({"abort_on_exception": True, "debug": "detail"})
    assert cfg.abort_on_exception is True and cfg.debug == "DETAIL"
    with pytest.raises(ValueError, match="unknown pg_options key 'abort'"):
        settings.parse_options({"abort": False})
    monkeypatch.setenv("SPMD_ABORT_ON_EXCEPTION", "maybe")
    with pytest.raises(ValueError, match="SPMD_ABORT_ON_EXCEPTION='maybe'"):
        settings.parse_options(None)
    with pytest.raises(ValueError, match="unknown level"):
        dist.set_debug_level("LOUD")


class _Group:
    """What a diagnosis reads of a group: two members, this process rank 0."""

    name, ranks, rank, timeout = "tp:0", [0, 1], 0, 5.0

    def group_rank(self, rank):
        return rank


class _Channel:
    """A control channel whose peers all answer that they reached the op."""

    threaded = True

    def query(self, peers, request, timeout):
        at = {"op": "all_reduce", "seq": request["seq"], "kind": "collective", "group": "tp:0",
              "engine": "?", "state": "started", "age": 6.0, "took": None}
        return {r: {"where": "main thread in spmd.all_reduce", "seq": request["seq"],
                    "p2p_seq": 0, "last": None, "current": [at], "at_seq": at} for r in peers}


@pytest.mark.parametrize("engine, where", [
    ("MPI", "it is stuck inside MPI (a rank may be blocked in it by an op on another group)"),
    ("shared memory", "it is stuck inside the shared-memory engine"),
    ("NCCL", "it is stuck inside NCCL on the GPU"),
])
def test_diagnosis_names_the_engine(monkeypatch, engine, where):
    from spmd.runtime import diagnosis, reliability

    monkeypatch.setattr(reliability.state, "channel", _Channel())
    text = diagnosis.diagnose("all_reduce", _Group(), 7, "collective", 6.0, "wait", engine)
    assert text.startswith(f"all_reduce: did not complete within 6.0 s (collective #7 on group "
                           f"tp:0, {engine}, group timeout 5 s) [rank 0, group tp:0]"), text
    assert f"every rank reached all_reduce #7; {where}" in text, text
    others = {"MPI", "shared memory", "NCCL"} - {engine}
    assert not any(f"inside {o}" in text for o in others), text
    alone = _Group()
    alone.ranks = [0]
    text = diagnosis.diagnose("all_reduce", alone, 7, "collective", 6.0, "wait", engine)
    assert ("its GPU has not finished the operation" in text) == (engine == "NCCL"), text
