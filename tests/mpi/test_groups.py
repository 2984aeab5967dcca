"""Groups: new_group (members only, or everybody), subgroups, split_group, rank
translation, non-members."""

import warnings

import numpy as np
import pytest

pytestmark = pytest.mark.mpi


def _sum_of_ranks(dist, pg):
    x = np.array([dist.get_rank()], np.int64)
    dist.all_reduce(x, group=pg)
    return int(x[0])


def test_new_group_all_ranks_call(dist):
    me, n = dist.get_rank(), dist.get_world_size()
    ranks = list(range(n - 1, -1, -2))  # unsorted on purpose: group ranks follow sorted order
    pg = dist.new_group(ranks)
    if me in ranks:
        assert isinstance(pg, dist.ProcessGroup)
        assert pg.ranks == sorted(ranks) == dist.get_process_group_ranks(pg)
        assert pg.rank() == sorted(ranks).index(me) == dist.get_rank(pg)
        assert pg.size() == len(ranks) == dist.get_world_size(pg)
        assert _sum_of_ranks(dist, pg) == sum(ranks)
        dist.destroy_process_group(pg)
    else:
        assert pg is dist.GroupMember.NON_GROUP_MEMBER
        assert dist.get_rank(pg) == -1 and dist.get_world_size(pg) == -1
        with pytest.warns(UserWarning, match="does not belong to the given group"):
            assert dist.all_reduce(np.zeros(1), group=pg) is None
        with pytest.warns(UserWarning):
            assert dist.recv(np.zeros(1), src=0, group=pg) == -1


def test_new_group_only_members_call(dist):
    me, n = dist.get_rank(), dist.get_world_size()
    if me % 2 == 1:
        return  # odd ranks do not call new_group at all
    evens = list(range(0, n, 2))
    pg = dist.new_group(evens, group_desc="evens")
    assert pg.name == "evens" and pg.ranks == evens
    assert _sum_of_ranks(dist, pg) == sum(evens)
    dist.destroy_process_group(pg)


def test_new_group_sort_ranks_false(dist):
    n = dist.get_world_size()
    ranks = list(range(n))[::-1]
    pg = dist.new_group(ranks, sort_ranks=False)
    assert pg.ranks == ranks
    assert pg.rank() == ranks.index(dist.get_rank())
    x = np.zeros(1)
    if pg.rank() == 0:
        x[0] = 42
    dist.broadcast(x, group_src=0, group=pg)  # group rank 0 is global rank n-1
    assert x[0] == 42
    assert dist.get_global_rank(pg, 0) == n - 1
    dist.destroy_process_group(pg)


def test_new_subgroups(dist):
    me, n = dist.get_rank(), dist.get_world_size()
    size = 2 if n % 2 == 0 else 1
    cur, subs = dist.new_subgroups(group_size=size)
    assert len(subs) == n // size
    mine = me // size
    assert subs[mine] is cur
    assert all(s is dist.GroupMember.NON_GROUP_MEMBER for i, s in enumerate(subs) if i != mine)
    expect = list(range(mine * size, mine * size + size))
    assert cur.ranks == expect
    assert _sum_of_ranks(dist, cur) == sum(expect)
    with pytest.raises(ValueError, match="must be positive and divide"):
        dist.new_subgroups(group_size=n + 1)
    dist.destroy_process_group(cur)


def test_new_subgroups_default_size_is_node_size(dist):
    cur, subs = dist.new_subgroups()
    from mpi4py import MPI

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    assert cur.size() == node.Get_size()
    node.Free()
    dist.destroy_process_group(cur)


def test_new_subgroups_by_enumeration(dist):
    me, n = dist.get_rank(), dist.get_world_size()
    lists = [[r for r in range(n) if r % 3 == k] for k in range(3)]
    lists = [lst for lst in lists if lst]
    cur, subs = dist.new_subgroups_by_enumeration(lists)
    k = me % 3
    assert cur.ranks == lists[k]
    assert _sum_of_ranks(dist, cur) == sum(lists[k])
    with pytest.raises(ValueError, match="must not overlap"):
        dist.new_subgroups_by_enumeration([[0], [0]])
    dist.destroy_process_group(cur)


def test_new_subgroups_by_enumeration_leaves_some_out(dist):
    me = dist.get_rank()
    cur, subs = dist.new_subgroups_by_enumeration([[0]])
    if me == 0:
        assert cur.ranks == [0]
        dist.destroy_process_group(cur)
    else:
        assert cur is None or cur is dist.GroupMember.NON_GROUP_MEMBER


def test_split_group_of_a_subgroup(dist):
    """split_ranks are group ranks of the parent; split of a split works."""
    me, n = dist.get_rank(), dist.get_world_size()
    parent = dist.new_group(list(range(n)))
    halves = [list(range(0, n, 2))] + ([list(range(1, n, 2))] if n > 1 else [])
    half = dist.split_group(parent, halves, group_desc="half")
    assert half.ranks == [r for r in range(n) if r % 2 == me % 2]
    # split the half again into singletons
    single = dist.split_group(half, [[i] for i in range(half.size())])
    assert single.ranks == [me] and single.size() == 1
    assert _sum_of_ranks(dist, single) == me
    none = dist.split_group(parent, [[0]])
    assert (none is None) == (me != 0)
    for pg in (single, half, parent) + ((none,) if none is not None else ()):
        dist.destroy_process_group(pg)
    with pytest.raises(RuntimeError, match="destroyed"):
        dist.all_reduce(np.zeros(1), group=half)


def test_rank_translation(dist):
    n = dist.get_world_size()
    ranks = list(range(1, n)) or [0]
    pg = dist.new_group(ranks)
    if dist.get_rank() in ranks:
        for i, g in enumerate(ranks):
            assert dist.get_group_rank(pg, g) == i
            assert dist.get_global_rank(pg, i) == g
        with pytest.raises(ValueError, match="not part of group"):
            dist.get_group_rank(pg, n + 5)
        with pytest.raises(ValueError, match="out of range"):
            dist.get_global_rank(pg, len(ranks))
        dist.destroy_process_group(pg)
    assert dist.get_group_rank(None, n - 1) == n - 1


def test_engines_works_and_recorder_see_the_groups_context(dist):
    """What the layers below the group read: one GroupContext per group, its plain fields
    agreeing with the ProcessGroup's torch API, given to its engine, its Works and its
    flight-recorder entries, and showing the group destroyed."""
    from spmd.core import flight_recorder as fr
    from spmd.core.context import GroupContext

    me, n = dist.get_rank(), dist.get_world_size()
    ranks = list(range(n - 1, -1, -1))
    pg = dist.new_group(ranks, sort_ranks=False, group_desc="reversed")
    ctx = pg.context
    assert type(ctx) is GroupContext and not isinstance(pg, GroupContext)
    assert (ctx.rank, ctx.size, list(ctx.ranks)) == (pg.rank(), pg.size(), pg.ranks)
    assert ctx.rank == n - 1 - me and ctx.name == pg.name == "reversed"
    assert ctx.timeout == pg.timeout.total_seconds() and ctx.comm is pg.comm
    assert [ctx.group_rank(r) for r in ranks] == list(range(n)) and ctx.group_rank(n) == -1
    assert [ctx.global_rank(i) for i in range(n)] == ranks
    with pytest.raises(AttributeError):
        ctx.colour = "red"  # slotted: a misspelt field fails where it is written
    x = np.full(3, me + 1.0)
    work = dist.all_reduce(x, group=pg, async_op=True)
    work.wait()
    np.testing.assert_array_equal(x, np.full(3, n * (n + 1) / 2))
    assert pg.engine_for("cpu").group is ctx and work.group is ctx
    assert [e.group for e in fr.recorder.entries() if e.op == "all_reduce"][-1] is ctx
    dist.destroy_process_group(pg)
    assert ctx.comm is None
    with pytest.raises(RuntimeError, match="all_reduce: group reversed was destroyed"):
        ctx.check_alive("all_reduce")


def test_group_argument_checks(dist):
    n = dist.get_world_size()
    with pytest.raises(ValueError, match="out of range"):
        dist.new_group([0, n])
    with pytest.raises(ValueError, match="duplicates"):
        dist.new_group([0, 0])
    with pytest.raises(TypeError, match="must hold ints"):
        dist.new_group(["0"])
    with pytest.raises(TypeError, match="group must be a ProcessGroup"):
        dist.all_reduce(np.zeros(1), group="WORLD")


def test_comm_attribute_is_usable_raw_mpi(dist):
    pg = dist.new_group(list(range(dist.get_world_size())))
    assert pg.comm.allreduce(1) == dist.get_world_size()
    dist.destroy_process_group(pg)


def test_non_member_gets_warning_not_hang(dist):
    me = dist.get_rank()
    pg = dist.new_group([0])
    if me != 0:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert dist.broadcast(np.zeros(1), src=0, group=pg) is None
            assert dist.all_gather_object([None], 1, group=pg) is None
            assert dist.barrier(group=pg) is None
        assert len(caught) == 3
    else:
        dist.destroy_process_group(pg)
