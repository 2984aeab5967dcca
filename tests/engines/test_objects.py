"""Object collectives: all_gather_object, gather_object, broadcast_object_list,
scatter_object_list, on WORLD and a subgroup."""

import numpy as np
import pytest

pytestmark = pytest.mark.mpi


def _obj(rank):
    # sizes differ by rank, so the byte counts are uneven
    return {"rank": rank, "payload": list(range(rank * 3)), "arr": np.arange(rank + 1.0)}


def _eq(a, b):
    assert a["rank"] == b["rank"] and a["payload"] == b["payload"]
    np.testing.assert_array_equal(a["arr"], b["arr"])


@pytest.mark.parametrize("group_kind", ["world", "parity"])
def test_all_gather_object(dist, groups, group_kind):
    pg = groups[group_kind]
    members = dist.get_process_group_ranks(pg)
    out = [None] * len(members)
    dist.all_gather_object(out, _obj(dist.get_rank()), group=pg)
    for o, r in zip(out, members):
        _eq(o, _obj(r))


@pytest.mark.parametrize("group_kind", ["world", "parity"])
def test_gather_object(dist, groups, group_kind):
    pg = groups[group_kind]
    members = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    for i, root in enumerate(members):
        out = [None] * len(members) if me == root else None
        kwargs = {"dst": root} if i % 2 else {"group_dst": i}
        dist.gather_object(_obj(me), out, group=pg, **kwargs)
        if me == root:
            for o, r in zip(out, members):
                _eq(o, _obj(r))


@pytest.mark.parametrize("group_kind", ["world", "parity"])
def test_broadcast_object_list(dist, groups, group_kind):
    pg = groups[group_kind]
    members = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    for i, root in enumerate(members):
        objs = [_obj(me), "s" * me, me] if me == root else [None, None, None]
        kwargs = {"src": root} if i % 2 else {"group_src": i}
        dist.broadcast_object_list(objs, group=pg, **kwargs)
        _eq(objs[0], _obj(root))
        assert objs[1:] == ["s" * root, root]


def test_broadcast_object_list_default_src_is_rank_0(dist):
    objs = ["hello", dist.get_rank()]
    dist.broadcast_object_list(objs)
    assert objs == ["hello", 0]


@pytest.mark.parametrize("group_kind", ["world", "parity"])
def test_scatter_object_list(dist, groups, group_kind):
    pg = groups[group_kind]
    members = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    for i, root in enumerate(members):
        ins = [_obj(100 + j) for j in range(len(members))] if me == root else None
        out = [None]
        kwargs = {"src": root} if i % 2 else {"group_src": i}
        dist.scatter_object_list(out, ins, group=pg, **kwargs)
        _eq(out[0], _obj(100 + pg.rank()))


def test_object_bad_input(dist):
    n = dist.get_world_size()
    with pytest.raises(ValueError, match=rf"object_list has {n + 1} entries, expected {n}"):
        dist.all_gather_object([None] * (n + 1), 1)
    with pytest.raises(TypeError, match="must be a list"):
        dist.all_gather_object((None,) * n, 1)
    with pytest.raises(ValueError, match="at least one entry"):
        dist.scatter_object_list([], [1] * n)
    with pytest.raises(ValueError, match="not both"):
        dist.broadcast_object_list([1], src=0, group_src=0)


@pytest.fixture
def tiny_rounds(monkeypatch):
    """Make every object transfer go in many small rounds, as objects past 2 GiB do."""
    from spmd.backends.mpi import objects

    monkeypatch.setattr(objects, "_CHUNK", 5)
    monkeypatch.setattr(objects, "_LIMIT", 23)


@pytest.mark.parametrize("group_kind", ["world", "parity"])
def test_object_collectives_in_rounds(dist, groups, group_kind, tiny_rounds):
    pg = groups[group_kind]
    members = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    out = [None] * len(members)
    dist.all_gather_object(out, _obj(me), group=pg)
    for o, r in zip(out, members):
        _eq(o, _obj(r))
    gathered = [None] * len(members) if pg.rank() == 0 else None
    dist.gather_object(_obj(me), gathered, group_dst=0, group=pg)
    if pg.rank() == 0:
        for o, r in zip(gathered, members):
            _eq(o, _obj(r))
    objs = [_obj(me), "x" * 50] if pg.rank() == 0 else [None, None]
    dist.broadcast_object_list(objs, group_src=0, group=pg)
    _eq(objs[0], _obj(members[0]))
    one = [None]
    dist.scatter_object_list(one, [_obj(200 + j) for j in range(len(members))] if pg.rank() == 0
                             else None, group_src=0, group=pg)
    _eq(one[0], _obj(200 + pg.rank()))
    if len(members) > 1:
        if pg.rank() == 0:
            dist.send_object_list([_obj(300), "y" * 40], group_dst=1, group=pg)
        elif pg.rank() == 1:
            got = [None, None]
            assert dist.recv_object_list(got, group=pg) == members[0]
            _eq(got[0], _obj(300))
            assert got[1] == "y" * 40
