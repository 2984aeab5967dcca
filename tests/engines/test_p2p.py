"""Point-to-point: send/recv, isend/irecv, any-source receives, batches, objects."""

import numpy as np
import pytest
from conftest import all_dtypes
from refs import make

pytestmark = pytest.mark.mpi
DTYPES = all_dtypes()


def _bits(a):
    a = np.ascontiguousarray(a)
    size = a.dtype.itemsize // (2 if a.dtype.kind == "c" else 1)
    return a.view(f"u{size}")


def test_ring_send_recv_every_dtype(dist):
    me, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        pytest.skip("send/recv needs two ranks")
    right, left = (me + 1) % n, (me - 1) % n
    for dt in DTYPES:
        x = make(me, (2, 3), dt)
        y = np.zeros((2, 6), dt)[:, ::2]  # receive into a strided view
        if me % 2 == 0:
            dist.send(x, dst=right)
            src = dist.recv(y, src=left)
        else:
            src = dist.recv(y, src=left)
            dist.send(x, dst=right)
        assert src == left
        np.testing.assert_array_equal(_bits(y), _bits(make(left, (2, 3), dt)))


def test_isend_irecv_tags_and_any_source(dist):
    me, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        pytest.skip("needs two ranks")
    if me == 0:
        got = {}
        for _ in range(n - 1):
            buf = np.zeros(3, np.int32)
            work = dist.irecv(buf, tag=5)  # any source
            work.wait()
            got[work.source_rank()] = buf.copy()
        assert sorted(got) == list(range(1, n))
        for r, buf in got.items():
            np.testing.assert_array_equal(buf, [r, r, r])
        # two tags from rank 1, received in the opposite order
        a, b = np.zeros(1, np.int64), np.zeros(1, np.int64)
        w2 = dist.irecv(b, src=1, tag=2)
        w1 = dist.irecv(a, src=1, tag=1)
        w1.wait()
        w2.wait()
        assert (a[0], b[0]) == (100, 200)
    else:
        dist.isend(np.full(3, me, np.int32), dst=0, tag=5).wait()
        if me == 1:
            w1 = dist.isend(np.array([100]), dst=0, tag=1)
            w2 = dist.isend(np.array([200]), dst=0, tag=2)
            w1.wait()
            w2.wait()


def test_group_peer_ranks(dist, groups):
    """dst/src are global ranks; group_dst/group_src are ranks in the group."""
    pg = groups["parity"]
    members = dist.get_process_group_ranks(pg)
    if len(members) < 2:
        pytest.skip("needs a group of two")
    gr = pg.rank()
    if gr == 0:
        dist.send(np.array([7.5]), group_dst=1, group=pg)
        dist.send(np.array([8.5]), dst=members[1], group=pg)
    elif gr == 1:
        a, b = np.zeros(1), np.zeros(1)
        assert dist.recv(a, group_src=0, group=pg) == members[0]
        assert dist.recv(b, src=members[0], group=pg) == members[0]
        assert (a[0], b[0]) == (7.5, 8.5)


def test_batch_isend_irecv_ring(dist):
    me, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        pytest.skip("needs two ranks")
    right, left = (me + 1) % n, (me - 1) % n
    sends = [np.full(4, me * 10 + k, np.float32) for k in range(2)]
    recvs = [np.zeros(4, np.float32) for _ in range(2)]
    ops = [dist.P2POp(dist.isend, sends[0], right), dist.P2POp(dist.irecv, recvs[0], left),
           dist.P2POp(dist.isend, sends[1], right, tag=1), dist.P2POp(dist.irecv, recvs[1], left, tag=1)]
    works = dist.batch_isend_irecv(ops)
    assert len(works) == 4
    for w in works:
        w.wait()
    for k in range(2):
        np.testing.assert_array_equal(recvs[k], np.full(4, left * 10 + k, np.float32))


def test_p2p_bad_input_raises_before_sending(dist):
    me, n = dist.get_rank(), dist.get_world_size()
    with pytest.raises(ValueError, match=r"send: dst is this rank itself.*\[rank \d+, group WORLD\]"):
        dist.send(np.zeros(1), dst=me)
    with pytest.raises(ValueError, match="not a member"):
        dist.send(np.zeros(1), dst=n + 3)
    with pytest.raises(ValueError, match="not both"):
        dist.recv(np.zeros(1), src=0, group_src=0)
    with pytest.raises(ValueError, match="tag=-1 is out of range"):
        dist.irecv(np.zeros(1), tag=-1)
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(2)
        ro.flags.writeable = False
        dist.irecv(ro)
    with pytest.raises(TypeError, match=r"must be a numpy array \(or a cupy array, .*\), got list"):
        dist.irecv([1, 2])
    with pytest.raises(ValueError, match="spmd.isend or spmd.irecv"):
        dist.P2POp(dist.send, np.zeros(1), 0)
    if n > 1:
        bad = [dist.P2POp(dist.isend, np.zeros(1), (me + 1) % n),
               dist.P2POp(dist.irecv, np.zeros(1), me)]  # second entry is invalid
        with pytest.raises(ValueError, match=r"batch_isend_irecv\[1\]"):
            dist.batch_isend_irecv(bad)
        # nothing was started: a matching pair still lines up afterwards
        right, left = (me + 1) % n, (me - 1) % n
        buf = np.zeros(1)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, np.array([float(me)]), right),
                                         dist.P2POp(dist.irecv, buf, left)]):
            w.wait()
        assert buf[0] == left


def test_send_recv_object_list(dist):
    me, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        pytest.skip("needs two ranks")
    if me == 0:
        for dst in range(1, n):
            dist.send_object_list([{"to": dst}, "x" * dst, None], dst=dst)
        got = [None]
        for _ in range(n - 1):
            src = dist.recv_object_list(got)  # any source
            assert got[0] == ("reply", src)
    else:
        objs = [None, None, None]
        assert dist.recv_object_list(objs, src=0) == 0
        assert objs == [{"to": me}, "x" * me, None]
        dist.send_object_list([("reply", me)], dst=0)
