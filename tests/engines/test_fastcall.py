"""The compiled call path (spmd.backends.mpi._fastcall, bound by spmd.backends.mpi.fastcall).

The suite runs with it on (where it is built) and off (SPMD_FASTCALL=0 in tests/run.sh);
these tests hold for both paths: every dtype and reduce op against numpy, a blocking op
past the group's timeout, other threads running during a long wait, groups the path
declines.  test_blocking_path.py checks which path took which call.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
from _late_outcomes import check_waiting_rank, some_rank_diagnosed

from spmd.backends.mpi import fastcall
from spmd.backends.reduction import PLANS, ReductionPlan
from spmd.core.dtypes import SUPPORTED_DTYPES
from spmd.core.ops import ReduceOp

SLACK = 4.0  # seconds a diagnosis may take beyond the timeout on a loaded machine


def _reference(values: list[np.ndarray], name: str) -> np.ndarray:
    fold = {"SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
            "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[name]
    if values[0].dtype == np.bool_:
        fold = {"SUM": np.logical_or, "MAX": np.logical_or, "PRODUCT": np.logical_and,
                "MIN": np.logical_and, "BXOR": np.logical_xor, "BAND": np.logical_and,
                "BOR": np.logical_or}[name]
    out = values[0]
    for v in values[1:]:
        out = fold(out, v)
    return out.astype(values[0].dtype)


def _data(dtype: np.dtype, rank: int) -> np.ndarray:
    base = np.arange(5) + 2 * rank + 1
    if dtype == np.bool_:
        return (base % 3 == 0)
    return base.astype(dtype)


@pytest.mark.mpi
def test_every_reduced_dtype_and_op_matches_numpy(dist):
    """Every (dtype, op) MPI reduces itself: all_reduce, reduce and reduce_scatter_tensor
    against numpy's fold of every rank's input."""
    n, r = dist.get_world_size(), dist.get_rank()
    checked = 0
    for name in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
        op = getattr(ReduceOp, name)
        for dt in SUPPORTED_DTYPES:
            plan = PLANS[name][dt]
            if type(plan) is not ReductionPlan or not plan.simple:
                continue
            want = _reference([_data(dt, k) for k in range(n)], name)
            x = _data(dt, r)
            dist.all_reduce(x, op=op)
            np.testing.assert_array_equal(x, want, err_msg=f"all_reduce {name} {dt}")
            y = _data(dt, r)
            dist.reduce(y, dst=0, op=op)
            np.testing.assert_array_equal(y, want if r == 0 else _data(dt, r),
                                          err_msg=f"reduce {name} {dt}")
            full = np.concatenate([_data(dt, r)] * n)
            part = np.empty(5, dt)
            dist.reduce_scatter_tensor(part, full, op=op)
            np.testing.assert_array_equal(part, want, err_msg=f"reduce_scatter {name} {dt}")
            checked += 1
    assert checked >= 30, checked


@pytest.mark.mpi
def test_every_moved_dtype_matches_numpy(dist):
    n, r = dist.get_world_size(), dist.get_rank()
    for dt in SUPPORTED_DTYPES:
        b = _data(dt, r)
        dist.broadcast(b, src=n - 1)
        np.testing.assert_array_equal(b, _data(dt, n - 1), err_msg=f"broadcast {dt}")
        out = np.empty((n, 5), dt)
        dist.all_gather_into_tensor(out, _data(dt, r))
        np.testing.assert_array_equal(out, [_data(dt, k) for k in range(n)], err_msg=str(dt))
        sent = np.stack([_data(dt, r + 10 * k) for k in range(n)])
        got = np.empty_like(sent)
        dist.all_to_all_single(got, sent)
        np.testing.assert_array_equal(got, [_data(dt, k + 10 * r) for k in range(n)],
                                      err_msg=f"all_to_all_single {dt}")
        if n > 1 and r < 2:
            if r == 0:
                dist.send(_data(dt, 7), dst=1, tag=11)
            else:
                msg = np.empty(5, dt)
                assert dist.recv(msg, src=0, tag=11) == 0
                np.testing.assert_array_equal(msg, _data(dt, 7), err_msg=f"send/recv {dt}")


@pytest.mark.mpi
def test_subgroups_and_other_ranks_as_roots(dist):
    """Groups of part of the world (their communicators' handles are not the world's),
    roots given as global ranks."""
    n, r = dist.get_world_size(), dist.get_rank()
    odd = dist.new_group([k for k in range(n) if k % 2 == 1])
    even = dist.new_group([k for k in range(n) if k % 2 == 0])
    mine = odd if r % 2 else even
    members = [k for k in range(n) if k % 2 == r % 2]
    x = np.full(3, float(r))
    dist.all_reduce(x, group=mine)
    np.testing.assert_array_equal(x, sum(members))
    b = np.full(2, r, np.int32)
    dist.broadcast(b, src=members[-1], group=mine)
    np.testing.assert_array_equal(b, members[-1])
    out = np.empty(len(members), np.int64)
    dist.all_gather_into_tensor(out, np.array([r]), group=mine)
    np.testing.assert_array_equal(out, members)
    dist.barrier(group=mine)
    dist.destroy_process_group(mine)   # the other one is GroupMember.NON_GROUP_MEMBER here


@pytest.mark.mpi
def test_blocking_op_past_the_timeout_is_diagnosed(dist):
    """A blocking all_reduce (the short path's case) whose peer comes late: the same
    diagnosed DistTimeoutError and broken group as a Work's wait."""
    n, me = dist.get_world_size(), dist.get_rank()
    if n < 2:
        pytest.skip("needs 2 ranks")
    late = n - 1
    g = dist.new_group(list(range(n)), timeout=timedelta(seconds=1))
    x = np.ones(2)
    g.engine_for("cpu")   # made by every rank before they meet: its set-up is all that
    dist.barrier()        # the first op below waits for, within the group's 1 s
    dist.all_reduce(x, group=g)
    outcome = None
    if me != late:
        t0 = time.monotonic()
        try:
            dist.all_reduce(x, group=g)
        except Exception as exc:  # noqa: BLE001 - checked after every rank met again
            outcome = exc
        waited = time.monotonic() - t0
        dist.barrier()
    else:
        dist.barrier()   # the straggler: here while the others time out
        try:    # told that the others gave the op up, it raises instead of completing it
            dist.all_reduce(x, group=g)
        except Exception as exc:  # noqa: BLE001 - checked after every rank met again
            outcome = exc
    dist.barrier()
    dist.destroy_process_group(g)
    if me == late:
        assert isinstance(outcome, dist.GroupBrokenError), repr(outcome)
        assert "(told by rank" in str(outcome), outcome
        some_rank_diagnosed(dist, False)
        return
    own = check_waiting_rank(dist, outcome, late)
    some_rank_diagnosed(dist, own)
    assert 1.0 <= waited < 1.0 + SLACK, waited
    if not own:
        return
    text = str(outcome)
    # The text gives the time measured: past 1.0 s by however long the rank was descheduled.
    assert re.search(r"all_reduce: did not complete within 1\.\d s \(collective #2 on group",
                     text), text
    assert f"rank {late}: last finished all_reduce #1" in text, text


@pytest.mark.mpi
def test_other_threads_run_while_a_call_waits(dist):
    """A blocking receive that waits hands the GIL over: a Python thread of the same
    rank keeps running meanwhile.

    The sender waits until that thread has ticked TICKS times during the receive (a
    flag file; every rank of the suite is on one host) or for LIMIT seconds, so the
    check depends little on how much CPU other processes leave this one: a receive
    that kept the GIL lets the thread tick at most once and fails after LIMIT seconds;
    one that hands it over too rarely takes longer than SLOW for the ticks, which take
    0.1 s (this test found two such: the GIL handed over once a second at 3 ranks on 2
    cores, and once in 256 polls at 2 ranks, where the thread ticked 3 times in 0.5 s
    in a process running the whole suite)."""
    TICKS, LIMIT, SLOW = 10, 30.0, 6.0
    n, r = dist.get_world_size(), dist.get_rank()
    if n < 2:
        pytest.skip("needs 2 ranks")
    box = [tempfile.mkdtemp(prefix="spmd-gil-") if r == 0 else None]
    dist.broadcast_object_list(box, src=0)
    flag = os.path.join(box[0], "ticked")
    if r == 1:
        deadline = time.monotonic() + LIMIT
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.005)
        dist.send(np.ones(4), dst=0, tag=21)
    elif r == 0:
        ticks = []
        stop = threading.Event()
        t0 = time.monotonic() + 3600.0  # set just before the receive

        def tick():
            while not stop.is_set():
                now = time.monotonic()
                if now > t0:
                    ticks.append(now)
                    if len(ticks) == TICKS:
                        open(flag, "w").close()
                time.sleep(0.01)

        t = threading.Thread(target=tick)
        buf = np.zeros(4)
        t.start()
        t0 = time.monotonic()
        assert dist.recv(buf, src=1, tag=21) == 1
        t1 = time.monotonic()
        stop.set()
        t.join()
        np.testing.assert_array_equal(buf, 1.0)
        during = [x for x in ticks if t0 < x < t1]
        assert len(during) >= TICKS, (len(during), t1 - t0)
        assert t1 - t0 < SLOW, f"{TICKS} ticks of 10 ms took {t1 - t0:.1f} s"
    dist.barrier()
    if r == 0:
        shutil.rmtree(box[0])


@pytest.mark.mpi
def test_coalescing_manager_takes_the_python_path(dist):
    """Calls inside coalescing_manager never reach the compiled path (the block's
    recorder stands in for the group's engine): results exact, no call counted on the
    group's FastComm."""
    n = dist.get_world_size()
    fast = dist.GroupMember.WORLD.engine_for("cpu").fast
    before = fast.taken if fast is not None else 0
    arrays = [np.full(3, float(k)) for k in range(4)]
    with dist.coalescing_manager():
        for a in arrays:
            dist.all_reduce(a)
    for k, a in enumerate(arrays):
        np.testing.assert_array_equal(a, k * n)
    if fast is not None:
        assert fast.taken == before


@pytest.mark.mpi
def test_group_state_is_pushed_to_the_compiled_path(dist, fresh):
    """What a FastComm needs of its group is pushed, not read (the public ops' entry
    only finds it: test_call_frames.py).  A group's host engine makes its FastComm; its
    timeout, ranks and sequence counters are the context's; breaking or destroying the
    group closes it at once."""
    from spmd.core import flight_recorder as fr
    from spmd.core.errors import GroupBrokenError

    if fastcall.compiled is None:
        pytest.skip(f"the compiled path is off: {fastcall.reason}")
    n, me = dist.get_world_size(), dist.get_rank()
    g, h = fresh(), fresh()
    fast = g.engine_for("cpu").fast
    x = np.full(4, me + 1, np.float32)
    dist.all_reduce(x, group=g, async_op=True).wait()   # a Work: not the compiled path
    np.testing.assert_array_equal(x, n * (n + 1) / 2)
    assert fast.alive and fast.taken == 0
    dist.barrier(group=g)            # (an op the shared-memory engine never takes)
    assert fast.taken == 1
    # the compiled call counted on the group's own counters, seen by the recorder
    assert fr.counters(g.context) == (2, 0)
    last = [e for e in fr.recorder.entries() if e.group is g.context][-1]
    assert (last.op, last.seq, last.size, last.dtype, last.state()) == \
        ("barrier", 2, None, None, "completed")
    # a root or peer out of range, a tag MPI cannot carry: declined, nothing sent
    assert fast.broadcast(x, n) is False and fast.send(x, me, 0) is False
    assert fast.recv(x, (me + 1) % n, -1) is False
    assert fast.taken == 1
    # broken: closed, and the engine's path raises for it on every rank alike
    g.context.mark_broken("a test broke it")
    assert not fast.alive and fast.barrier() is False
    with pytest.raises(GroupBrokenError, match="a test broke it"):
        dist.barrier(group=g)
    # destroyed: closed
    fast_h = h.engine_for("cpu").fast
    dist.destroy_process_group(h)
    assert not fast_h.alive and fast_h.barrier() is False


@pytest.mark.mpi
def test_all_reduce_coalesced_fuses_in_one_call(dist, monkeypatch):
    """The compiled all_reduce_coalesced (packs, reduces once, unpacks) gives numpy's
    result; lists it declines (mixed dtypes, a view, over the fusion limit) give the
    same through the Python path."""
    from spmd.backends.mpi import packing

    n, r = dist.get_world_size(), dist.get_rank()
    fast = dist.GroupMember.WORLD.engine_for("cpu").fast
    taken = []

    def value(a, k):
        return np.full(a.shape, k % 2 == 0 if a.dtype == np.bool_ else k + 1, a.dtype)

    def case(arrays, op=ReduceOp.SUM):
        want = [_reference([value(a, k) for k in range(n)], op.name) for a in arrays]
        mine = [value(a, r) for a in arrays]
        for i, m in enumerate(mine):
            if m.shape == (4, 2):     # made a view of a wider array (not contiguous)
                mine[i] = np.zeros((4, 4), m.dtype)[:, ::2]
                mine[i][...] = m
        before = fast.taken if fast is not None else 0
        dist.all_reduce_coalesced(mine, op=op)
        taken.append(fast is not None and fast.taken == before + 1)
        for got, w in zip(mine, want):
            np.testing.assert_array_equal(got, w)

    shapes = [(3,), (2, 4), (), (7,), (0,), (5, 1)]
    case([np.zeros(s, np.float32) for s in shapes])
    case([np.zeros(s, np.int64) for s in shapes], ReduceOp.MAX)
    case([np.zeros(s, np.bool_) for s in shapes[:3]], ReduceOp.MIN)
    expect = [True, True, True]
    case([np.zeros(3, np.float32), np.zeros(3, np.float64)])         # two dtypes
    case([np.zeros((4, 2)), np.zeros(3)])                             # a view (above)
    monkeypatch.setattr(packing, "_bucket_bytes", 16)
    case([np.zeros(3), np.zeros(3), np.zeros(2)])                     # three buckets
    expect += [False, False, False]
    if fast is not None:
        assert taken == expect
    # recorded once per fused call, like the Python path's Work
    from spmd.core import flight_recorder as fr
    last = [e for e in fr.recorder.entries() if e.group is dist.GroupMember.WORLD.context][-1]
    assert last.op == "all_reduce_coalesced" and last.state() == fr.COMPLETED


@pytest.mark.mpi
def test_all_reduce_coalesced_ranks_on_either_path_meet(dist):
    """Rank 0's list holds a view (the Python path), the other ranks' lists do not (the
    compiled path): both paths choose the same engine from the same sizes (MPI below the
    shared-memory engine's all_reduce size, the engine from it), so the ranks meet and
    agree, below and above that size."""
    n, r = dist.get_world_size(), dist.get_rank()
    shm = dist.GroupMember.WORLD.engine_for("cpu").shm
    sizes = [4096]
    if shm is not None and shm.all_reduce_from < (1 << 22):
        sizes.append(max(2 * shm.all_reduce_from, 8192))
    for total in sizes:
        count = total // 4 // 8
        arrays = [np.full(count, float(r + k), np.float32) for k in range(8)]
        if r == 0:
            wide = np.zeros((count, 2), np.float32)
            wide[:, 0] = arrays[3]
            arrays[3] = wide[:, 0]                   # same values, not contiguous
        dist.all_reduce_coalesced(arrays)
        for k, a in enumerate(arrays):
            np.testing.assert_array_equal(a, sum(q + k for q in range(n)), err_msg=str(total))


@pytest.mark.mpi
def test_all_reduce_coalesced_refuses_a_read_only_array(dist):
    """The compiled path reads numpy's flags itself: a read-only array in the list is
    declined there and refused by the Python path's check, before anything is sent."""
    arrays = [np.ones(4), np.ones(4), np.ones(4)]
    arrays[1].flags.writeable = False
    with pytest.raises(ValueError, match=r"tensors\[1\] is read-only"):
        dist.all_reduce_coalesced(arrays)
    np.testing.assert_array_equal(arrays[0], 1.0)


@pytest.mark.mpi
def test_host_arrays_is_array_lists_check_in_one_call(dist):
    """fastcall.host_arrays accepts exactly the output lists array_list passes as they
    are (exact, writable numpy arrays of supported dtypes); anything else goes to
    array_list, which raises its own errors."""
    good = [np.zeros(3, np.float32), np.zeros((2, 2), np.int64), np.zeros(0, np.bool_)]
    ro = np.zeros(2)
    ro.flags.writeable = False
    cases = {"good": (good, True), "tuple": (tuple(good), True), "empty": ([], True),
             "read-only": (good + [ro], False), "object dtype": ([np.zeros(2, object)], False),
             "a list of lists": ([[1.0]], False), "a subclass": ([np.ma.zeros(2)], False),
             "not a list": (np.zeros(2), False)}
    for name, (items, want) in cases.items():
        got = fastcall.host_arrays(items)
        assert got == (want and fastcall.compiled is not None), name
    with pytest.raises(ValueError, match="read-only"):
        dist.all_reduce_coalesced(good + [ro])
    with pytest.raises(TypeError, match="object"):
        dist.all_reduce_coalesced([np.zeros(2, object), np.zeros(2, object)])
