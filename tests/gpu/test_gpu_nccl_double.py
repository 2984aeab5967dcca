"""The NCCL engine on the device double (spmd.testing.device_double, installed by
SPMD_TEST_DEVICE=double) at every world size, where there is no GPU, and
deterministically (the double can hold its device): a Work's stream semantics, reaping,
asynchronous errors, host timeouts; the watchdog, the flight recorder and the
diagnoses: an NCCL job that idles past its timeout keeps its groups, a real NCCL hang
is reported naming NCCL, the op, the group and the ranks, and its communicator held:
reads of the op's outputs wait until the program gives the group up, and only a process
that stays up after device timeouts ever lets them go."""

import threading
import time
from datetime import timedelta

import numpy as np
import pytest
from _gpu_helpers import on_device_double

from spmd.core import flight_recorder as fr
from spmd.testing import device_double as dd

pytestmark = pytest.mark.mpi
if not on_device_double():
    pytest.skip("runs on the device double: SPMD_TEST_DEVICE=double (tests/run.sh does)",
                allow_module_level=True)

SPEC = "cpu:mpi,cuda:nccl"


@pytest.fixture
def double(dist):
    """The device double's cupy, with the device running."""
    yield dd.cupy
    dd.release()


@pytest.fixture
def nccl_group(monkeypatch, fresh, double):
    """Makes a new group of every rank whose GPU arrays go to NCCL, with a 1 s timeout.

    These tests time NCCL ops out on purpose and look at what follows in the process, so
    the device-timeout policy is "raise" here; the default ("abort": the job ends) is
    tested on whole jobs (tests/jobs/test_gpu_timeout_jobs.py).  ``monkeypatch`` comes
    first so that it undoes the policy after ``fresh`` has destroyed the groups: a held
    communicator is then let go, not abandoned with its stream blocked."""
    from spmd.runtime.reliability import state

    monkeypatch.setattr(state.config, "device_timeout", "raise")
    return lambda desc: fresh(backend=SPEC, timeout=timedelta(seconds=1), group_desc=desc)


def _reports_since(seen, text):
    from spmd.runtime import reliability

    return [r for r in list(reliability.reports)[seen:] if text in r]


def _wait_for_report(seen, text, seconds=10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = _reports_since(seen, text)
        if found:
            return found
        time.sleep(0.05)
    return []


def test_idle_nccl_group_outlives_its_timeout(dist, double, nccl_group):
    """Finished NCCL ops nobody polled (a blocking all_reduce, an async one whose Work was
    dropped) are not "in flight": a group idle for longer than its timeout is kept."""
    from spmd.runtime import reliability

    cp, n = double, dist.get_world_size()
    g = nccl_group("idle-nccl")
    x = cp.ones(4, cp.float32)
    dist.all_reduce(x, group=g)
    dist.all_reduce(cp.ones(2, cp.float32), group=g, async_op=True)  # Work dropped
    dd.runtime.deviceSynchronize()  # both finished on the device; nobody polled their Works
    seen = len(reliability.reports)
    time.sleep(3.5)  # past the timeout (1 s), the watchdog's grace (1 s) and its interval
    assert not _reports_since(seen, "idle-nccl"), list(reliability.reports)[seen:]
    assert g.context.error is None
    dist.all_reduce(x, group=g)  # the group still works
    np.testing.assert_array_equal(x.get(), np.full(4, n * n, np.float32))
    mine = [e for e in fr.recorder.snapshot()["entries"] if e["group"] == "idle-nccl"]
    assert [e["op"] for e in mine] == ["all_reduce"] * 3
    assert all(e["engine"] == "NCCL" for e in mine)
    assert all(e["state"] == "completed" for e in mine[:2]), mine
    assert not any(e["timed_out"] for e in mine)


def test_finished_ops_leave_the_in_flight_list_without_a_poll(dist, double, nccl_group):
    """The recorder asks the device: an op is in flight until its end event has passed,
    and its end time is when that was first seen, even if its Work is never looked at."""
    cp = double
    g = nccl_group("settle-nccl")
    dist.all_reduce(cp.ones(1, cp.float32), group=g)  # connects the communicator
    dd.runtime.deviceSynchronize()
    dd.hold()
    try:
        dist.all_reduce(cp.ones(1, cp.float32), group=g, async_op=True)
        summary = fr.recorder.group_summary(g.context)
    finally:
        dd.release()
    assert [c["op"] for c in summary["current"]] == ["all_reduce"], summary
    assert summary["current"][0]["engine"] == "NCCL"
    dd.runtime.deviceSynchronize()
    summary = fr.recorder.group_summary(g.context)
    assert summary["current"] == [] and summary["last"]["seq"] == 2
    assert not [e for e in fr.recorder.in_flight() if e.group is g.context]


def _reader(x) -> tuple[threading.Thread, list]:
    """A thread that reads ``x`` (``x.get()``) at once; the list gets what it read."""
    got: list = []
    t = threading.Thread(target=lambda: got.append(x.get()), daemon=True)
    t.start()
    return t, got


def test_nccl_hang_is_reported_and_held(dist, double, nccl_group):
    """Every rank calls; the device never finishes (held): the watchdog reports the op as
    stuck in NCCL on the GPU, breaks the group and holds its communicator (not aborted:
    that would let the streams waiting for the op go on)."""
    from spmd.runtime import reliability

    cp, n = double, dist.get_world_size()
    g = nccl_group("hang-nccl")
    dist.all_reduce(cp.ones(1, cp.float32), group=g)
    dd.runtime.deviceSynchronize()
    backend = g.engine_for("cuda")
    seen = len(reliability.reports)
    dd.hold()
    try:
        work = dist.all_reduce(cp.ones(3, cp.float32), group=g, async_op=True)
        found = _wait_for_report(seen, "hang-nccl")
        # Every rank's watchdog asks the others where they are: nobody leaves the group
        # until all have their reports.
        dist.barrier()
    finally:
        dd.release()
    assert found, "the watchdog did not report the NCCL op the device never finished"
    text = found[0]
    assert "spmd watchdog: all_reduce #2 on group hang-nccl is still running on the GPU " \
           "(NCCL)" in text, text
    assert "(collective #2 on group hang-nccl, NCCL, group timeout 1 s)" in text, text
    if n == 1:
        assert "this rank is the only member, and its GPU has not finished the " \
               "operation" in text, text
    else:
        assert "every rank reached all_reduce #2; it is stuck inside NCCL on the GPU" in text
        assert "reached it: rank" in text
    assert "stuck inside MPI" not in text
    assert "the group's NCCL communicator is held, not aborted: the op's stream stays " \
           "blocked until the group is destroyed" in text, text
    communicator = backend.communicator
    assert g.context.error is not None and communicator.broken is not None
    assert communicator.group_broken   # the context's end reached it
    assert communicator.held and not communicator.nccl_comm._aborted
    with pytest.raises(dist.GroupBrokenError, match="the group's NCCL communicator is held "
                       "after all_reduce #2 timed out"):
        work.synchronize()
    with pytest.raises(dist.GroupBrokenError):
        dist.all_reduce(cp.ones(1, cp.float32), group=g)


def test_nccl_op_a_peer_never_joins(dist, double, nccl_group):
    """Rank 0 alone calls, and reads the output at once: the others are named as not
    having reached the op, and the read waits past the report until the group is
    destroyed (the policy here is "raise": only then is the communicator aborted)."""
    from spmd.runtime import reliability

    n, me = dist.get_world_size(), dist.get_rank()
    if n == 1:
        pytest.skip("needs a peer that does not call")
    cp = double
    g = nccl_group("alone-nccl")
    dist.all_reduce(cp.ones(1, cp.float32), group=g)
    dd.runtime.deviceSynchronize()
    seen = len(reliability.reports)
    found = []
    if me == 0:
        x = cp.full(2, 7, cp.float32)
        dist.all_reduce(x, group=g)          # returns once enqueued
        reader, got = _reader(x)
        found = _wait_for_report(seen, "alone-nccl")
        blocked = reader.is_alive()
        communicator = g.engine_for("cuda").communicator
        assert communicator.held and not communicator.nccl_comm._aborted
    dist.barrier()
    dist.destroy_process_group(g)           # gives it up: the held stream is let go
    if me == 0:
        assert found, "the watchdog did not report the NCCL op no peer joined"
        text = found[0]
        assert "all_reduce #2 on group alone-nccl is still running on the GPU (NCCL)" in text
        assert "ranks that have not reached all_reduce #2:" in text, text
        assert "rank 1" in text
        assert blocked, f"the read returned {got} before the group was given up"
        reader.join(timeout=30)
        assert communicator.aborted and not reader.is_alive()
        np.testing.assert_array_equal(got[0], np.full(2, 7, np.float32))  # not results


def test_host_wait_timeout_names_nccl(dist, double, nccl_group):
    """Rank 0's host wait times out (its device held; the others do not wait, so none of
    them breaks the group first): the diagnosis names NCCL, and the communicator is held,
    not aborted."""
    cp, me = double, dist.get_rank()
    g = nccl_group("wait-nccl")
    dist.all_reduce(cp.ones(1, cp.float32), group=g)
    dd.runtime.deviceSynchronize()
    info = None
    if me == 0:
        dd.hold()
    try:
        work = dist.all_reduce(cp.ones(1, cp.float32), group=g, async_op=True)
        if me == 0:
            with pytest.raises(dist.DistTimeoutError) as info:
                work.synchronize(timeout=0.3)
    finally:
        dd.release()
    dd.runtime.deviceSynchronize()   # the device catches up (held, not aborted: it can)
    if me == 0:
        assert info is not None
        text = str(info.value)
        assert "(collective #2 on group wait-nccl, NCCL, group timeout 1 s)" in text, text
        assert "(timed out waiting on the host)" in text and "is now broken" in text, text
        communicator = g.engine_for("cuda").communicator
        assert communicator.held and not communicator.nccl_comm._aborted
        with pytest.raises(dist.GroupBrokenError, match=r"broadcast: the group's NCCL "
                           "communicator is held after all_reduce timed out: that op's "
                           "outputs are not results"):
            communicator.check("broadcast")
    dist.barrier()
    g2 = nccl_group("barrier-nccl")
    dist.all_reduce(cp.ones(1, cp.float32), group=g2)
    dd.runtime.deviceSynchronize()
    if me == 0:
        dd.hold()
    try:  # a barrier's wait blocks the host
        work = dist.barrier(group=g2, async_op=True, device_ids=[0])
        if me == 0:
            with pytest.raises(dist.DistTimeoutError, match="barrier: did not complete"):
                work.wait(timeout=0.2)
    finally:
        dd.release()
    dd.runtime.deviceSynchronize()
    dist.barrier()


@pytest.mark.parametrize("policy", ["raise", "abort"])
def test_a_held_group_given_up_lets_its_stream_go_only_where_the_process_stays_up(
        dist, double, fresh, monkeypatch, policy):
    """Rank 0's op is held (as a timeout holds it; the group's own timeout is far away):
    a read of its output waits, and destroying the group aborts the communicator, letting
    the read return, only under "raise"; under "abort" (the process is ending) the
    communicator is abandoned with the read still waiting."""
    from spmd.backends.nccl import communicator as nccl_communicator
    from spmd.runtime.reliability import state

    if dist.get_world_size() == 1:
        pytest.skip("needs a peer that does not call")
    monkeypatch.setattr(state.config, "device_timeout", policy)
    cp, me = double, dist.get_rank()
    g = fresh(backend=SPEC, timeout=timedelta(seconds=60), group_desc=f"held-{policy}")
    dist.all_reduce(cp.ones(1, cp.float32), group=g)
    dd.runtime.deviceSynchronize()
    dist.barrier()
    if me != 0:
        dist.barrier()
        dist.destroy_process_group(g)
        return
    x = cp.full(3, 5, cp.float32)
    dist.all_reduce(x, group=g)              # the peers never join it
    communicator = g.engine_for("cuda").communicator
    comm = communicator.nccl_comm
    communicator.hold("all_reduce #2 timed out (in this test)")
    reader, got = _reader(x)
    with pytest.raises(dist.GroupBrokenError, match="is held after all_reduce #2 timed out"):
        dist.all_reduce(cp.ones(1, cp.float32), group=g)
    dist.barrier()
    dist.destroy_process_group(g)
    try:
        if policy == "raise":
            reader.join(timeout=30)
            assert communicator.aborted and comm._aborted and not reader.is_alive()
            np.testing.assert_array_equal(got[0], np.full(3, 5, np.float32))  # not results
        else:
            assert not communicator.aborted and not comm._aborted
            assert communicator in nccl_communicator.abandoned
            reader.join(timeout=0.5)
            assert reader.is_alive(), f"the read returned {got} in a process that ends"
    finally:  # this process goes on with the next test: let the read go
        comm.abort()
        reader.join(timeout=30)
        if communicator in nccl_communicator.abandoned:
            nccl_communicator.abandoned.remove(communicator)


def test_work_orders_the_stream_not_the_host(dist, double, nccl_group):
    """wait() returns at once and orders the caller's stream after the op (a kernel queued
    after it sees the result); the host learns of completion through synchronize()."""
    cp, n = double, dist.get_world_size()
    g = nccl_group("work-nccl")
    x = cp.ones(4, cp.float32)
    dist.all_reduce(x, group=g)
    dd.runtime.deviceSynchronize()
    dd.hold()
    try:
        work = dist.all_reduce(x, group=g, async_op=True)
        assert isinstance(work, dist.Work)
        assert work.wait() is True and not work.is_completed()  # the device is held
        y = x + 1  # queued on the current stream, after the all_reduce
    finally:
        dd.release()
    np.testing.assert_array_equal(y.get(), np.full(4, n * n + 1, np.float32))
    work.synchronize()
    assert work.is_completed() and work.is_success() and work.result()[0] is x
    fut = dist.all_reduce(x, group=g, async_op=True).get_future()
    assert fut.wait()[0] is x


def test_finished_works_are_reaped(dist, double, nccl_group):
    """The next launch completes every op whose end event has passed and releases its
    arrays; dropped Works' recorder entries are finished too."""
    cp = double
    g = nccl_group("reap-nccl")
    kept = [dist.all_reduce(cp.ones(8, cp.float32), group=g, async_op=True) for _ in range(5)]
    for _ in range(5):
        dist.all_reduce(cp.ones(8, cp.float32), group=g, async_op=True)  # dropped
    dd.runtime.deviceSynchronize()
    backend = g.engine_for("cuda")
    dist.all_reduce(cp.ones(1, cp.float32), group=g)
    assert len(backend.communicator.inflight) <= 1
    assert all(w.is_completed() and w.keep is None for w in kept)
    mine = [e for e in fr.recorder.entries() if e.group is g.context]
    assert all(e.t1 is not None for e in mine[:-1]), mine


def test_async_error_aborts_and_names_the_op(dist, double, nccl_group):
    cp = double
    g = nccl_group("error-nccl")
    dist.all_reduce(cp.ones(1, cp.float32), group=g)
    dd.runtime.deviceSynchronize()
    backend = g.engine_for("cuda")
    dd.hold()
    try:
        work = dist.reduce_scatter_tensor(cp.zeros(1, cp.float32),
                                          cp.ones(dist.get_world_size(), cp.float32),
                                          group=g, async_op=True)
        backend.communicator.nccl_comm.inject_error("a peer's connection closed")
        with pytest.raises(dist.DistBackendError, match=r"reduce_scatter_tensor: NCCL reported "
                           r"an asynchronous error: .*a peer's connection closed; the "
                           r"communicator was aborted \[rank \d+, group error-nccl\]"):
            work.wait()
    finally:
        dd.release()
    assert backend.communicator.nccl_comm._aborted
    # NCCL's error breaks the group too: one ended state, which the engines follow
    assert "an asynchronous NCCL error in reduce_scatter_tensor on rank" in g.context.error
    assert backend.communicator.group_broken
    with pytest.raises(dist.GroupBrokenError, match="aborted after an asynchronous NCCL error"):
        work.is_completed()
    with pytest.raises(dist.GroupBrokenError):
        dist.all_reduce(cp.ones(1, cp.float32), group=g)


def test_blocking_recv_orders_the_stream(dist, double, nccl_group):
    """A blocking recv() returns once the caller's stream is ordered after the receive:
    reading the buffer then sees the data."""
    n, me = dist.get_world_size(), dist.get_rank()
    if n == 1:
        pytest.skip("needs two ranks")
    cp = double
    g = nccl_group("recv-nccl")
    dist.all_reduce(cp.ones(1, cp.float32), group=g)  # every member creates the communicator
    if me == 0:
        dist.send(cp.arange(6, dtype=cp.int64) + 100, dst=1, group=g)
    elif me == 1:
        buf = cp.zeros(6, cp.int64)
        assert dist.recv(buf, src=0, group=g) == 0
        np.testing.assert_array_equal(buf.get(), np.arange(6) + 100)
    dd.runtime.deviceSynchronize()


def test_shrinking_aborts_the_old_nccl_communicator_and_bootstraps_a_new_one(dist, double):
    """shrink_group ends the old group on this rank alone (its NCCL communicator aborted,
    never destroyed collectively) and the new group's first GPU op bootstraps NCCL over
    the survivors' MPI communicator."""
    n, me = dist.get_world_size(), dist.get_rank()
    if n == 1:
        pytest.skip("needs a rank to exclude")
    g = dist.new_group(list(range(n)), backend=SPEC)
    x = double.full(4, me + 1.0, double.float32)
    dist.all_reduce(x, group=g)                  # connects g's NCCL communicator
    np.testing.assert_array_equal(double.asnumpy(x), np.full(4, n * (n + 1) / 2))
    old = g.engine_for("cuda").communicator
    if me == n - 1:                               # the excluded rank does not call it
        dist.barrier()
        dist.destroy_process_group(g)
        return
    new = dist.shrink_group([n - 1], g)
    assert old.broken is not None and old.nccl_comm is None   # aborted, then dropped
    y = double.full(3, me + 1.0, double.float32)
    dist.all_reduce(y, group=new)
    np.testing.assert_array_equal(double.asnumpy(y), np.full(3, (n - 1) * n / 2))
    fresh = new.engine_for("cuda").communicator
    assert fresh is not old and fresh.broken is None and fresh.nccl_comm is not None
    with pytest.raises(RuntimeError, match="destroyed"):
        dist.all_reduce(x, group=g)
    dist.destroy_process_group(new)
    dist.barrier()
