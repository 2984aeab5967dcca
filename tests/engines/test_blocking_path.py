"""The host engine's compiled path: the blocking calls it takes give the numpy reference
on every rank and are recorded like any op; every other call takes the engine's Work
path, with the same results and errors.

Which path ran is read from the group's FastComm (its ``taken`` count): nothing is
patched or renamed.  With the compiled path off (SPMD_FASTCALL=0 in tests/run.sh, or no
compiler) it takes no call, and the same results come from the Work path."""

import numpy as np
import pytest

from spmd.backends.mpi import fastcall
from spmd.core import flight_recorder as fr
from spmd.core import work as work_mod

pytestmark = pytest.mark.mpi


@pytest.fixture
def taken(dist):
    """() -> how many calls the compiled path has run since the test started."""
    dist.all_reduce(np.zeros(1))  # the group's host engine exists from here on
    fast = _host(dist).fast
    assert (fast is None) == (fastcall.compiled is None)
    start = 0 if fast is None else fast.taken
    return lambda: 0 if fast is None else fast.taken - start


def _host(dist):
    return dist.GroupMember.WORLD.engines["cpu"]


def _shm_takes(dist, kind: str, nbytes: int) -> bool:
    shm = _host(dist).shm
    return shm is not None and nbytes >= getattr(shm, kind)


def test_small_blocking_ops_take_it_and_match_numpy(dist, taken):
    n, r = dist.get_world_size(), dist.get_rank()
    seq0 = fr.next_seq(dist.GroupMember.WORLD.context)
    expect = []

    x = np.arange(6, dtype=np.float32).reshape(2, 3) + r
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    np.testing.assert_array_equal(x, np.arange(6, dtype=np.float32).reshape(2, 3) + n - 1)
    expect += [] if _shm_takes(dist, "all_reduce_from", x.nbytes) else ["all_reduce"]

    flags = np.array([r == 0, r % 2 == 1, True])   # bool: reduced as uint8
    dist.all_reduce(flags)
    np.testing.assert_array_equal(flags, [True, n > 1, True])
    expect += [] if _shm_takes(dist, "all_reduce_from", flags.nbytes) else ["all_reduce"]

    y = np.full(4, r + 1, np.int64)
    dist.reduce(y, dst=n - 1)
    want = n * (n + 1) // 2 if r == n - 1 else r + 1
    np.testing.assert_array_equal(y, np.full(4, want))
    expect += [] if _shm_takes(dist, "reduce_from", y.nbytes) else ["reduce"]

    b = np.full(3, r, np.float16)
    dist.broadcast(b, src=n - 1)
    np.testing.assert_array_equal(b, np.full(3, n - 1, np.float16))
    expect += [] if _shm_takes(dist, "broadcast_from", b.nbytes) else ["broadcast"]

    gathered = np.empty((n, 2), np.int32)
    dist.all_gather_into_tensor(gathered, np.array([r, -r], np.int32))
    np.testing.assert_array_equal(gathered, [[k, -k] for k in range(n)])
    expect += [] if _host(dist).shm is not None and _host(dist).shm.gathers(gathered.nbytes) \
        else ["all_gather_into_tensor"]

    full = np.arange(2.0 * n) * (r + 1)
    part = np.empty(2)
    dist.reduce_scatter_tensor(part, full)
    np.testing.assert_array_equal(part, np.arange(2.0 * n)[2 * r:2 * r + 2] * n * (n + 1) / 2)
    expect += [] if _shm_takes(dist, "reduce_scatter_from", full.nbytes) \
        else ["reduce_scatter_tensor"]

    sent = np.arange(n * 2, dtype=np.float64).reshape(n, 2) + 100 * r
    got = np.empty_like(sent)
    dist.all_to_all_single(got, sent)
    np.testing.assert_array_equal(got, [[100 * k + 2 * r, 100 * k + 2 * r + 1] for k in range(n)])
    expect.append("all_to_all_single")

    dist.barrier()
    expect.append("barrier")

    if n > 1 and r < 2:
        msg = np.empty(5, np.uint8)
        if r == 0:
            dist.send(np.arange(5, dtype=np.uint8), dst=1, tag=3)
            expect.append("send")
        else:
            assert dist.recv(msg, src=0, tag=3) == 0
            np.testing.assert_array_equal(msg, np.arange(5))
            expect.append("recv")

    assert taken() == (len(expect) if fastcall.compiled is not None else 0), expect
    # recorded like any op: collectives numbered on from where they were, all completed
    entries = [e for e in fr.recorder.entries() if e.group is dist.GroupMember.WORLD.context
               and e.kind == "collective"][-8:]
    assert [e.seq for e in entries] == list(range(seq0, seq0 + 8))
    assert all(e.state() == fr.COMPLETED for e in entries)


def test_everything_else_takes_the_work_path(dist, taken):
    n, r = dist.get_world_size(), dist.get_rank()
    base = np.ones((4, 4))
    dist.all_reduce(base[:, ::2])                       # a view
    np.testing.assert_array_equal(base[:, ::2], n)
    np.testing.assert_array_equal(base[:, 1::2], 1)
    h = np.full(3, 1.5, np.float16)
    dist.all_reduce(h)                                  # reduced in float32
    np.testing.assert_array_equal(h, np.full(3, 1.5 * n, np.float16))
    avg = np.full(2, float(r))
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)          # a finish step
    np.testing.assert_allclose(avg, (n - 1) / 2)
    w = dist.all_reduce(np.ones(2), async_op=True)      # a Work was asked for
    assert w.wait()
    counts = [1] * n
    out = np.empty(n)
    dist.all_to_all_single(out, np.full(n, float(r)), counts, counts)   # split sizes
    np.testing.assert_array_equal(out, np.arange(n))
    ro = np.ones(2)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):  # the ordinary path's error
        dist.all_reduce(ro)
    with pytest.raises(TypeError, match="unsupported dtype"):
        dist.broadcast(np.array(["a"]), src=0)
    if n > 1 and r < 2:
        msg = np.empty(2)
        if r == 0:
            dist.send(np.ones(2), dst=1)
        else:
            assert dist.recv(msg) == 0                  # any source: needs the status
    assert taken() == (1 if n > 1 and r == 0 and fastcall.compiled is not None else 0)


def test_other_observers_get_a_work_for_every_op(dist, taken):
    seen = []

    class Watcher:
        def started(self, work):
            seen.append(work.op)

        def completed(self, work):
            pass

    watcher = Watcher()
    work_mod.add_observer(watcher)
    try:
        x = np.ones(3)
        dist.all_reduce(x)
        dist.broadcast(x, src=0)
        dist.barrier()
    finally:
        work_mod.remove_observer(watcher)
    assert taken() == 0
    assert seen == ["all_reduce", "broadcast", "barrier"]
    np.testing.assert_array_equal(x, dist.get_world_size())
