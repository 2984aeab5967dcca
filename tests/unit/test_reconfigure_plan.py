"""Reconfigure handles of the spmd backend and the plan the handles make (one process,
no MPI: the plan is what every process derives alike from the same handles)."""

import pytest

pytest.importorskip("torch", reason="torch is not installed")

from spmd.torch._handles import Handle, plan  # noqa: E402 - after the skip without torch


def world(wid: str, n: int, parent: str = "", port: str = "") -> list[Handle]:
    """The handles of a world of ``n`` (its rank 0 with ``port``)."""
    return [Handle(wid, r, n, parent, port if r == 0 else "") for r in range(n)]


def test_a_handle_is_a_string_that_comes_back_as_itself():
    for h in (Handle("a1", 2, 4), Handle("kid", 0, 1, parent="a1"),
              Handle("b", 0, 3, port="tag#0$description#host$port#123$ifname#lo$")):
        text = h.encode()
        assert isinstance(text, str) and text.startswith("spmd:")
        assert Handle.decode(text, "handles[0]") == h
    # the same handle from the same fields, whoever makes it: spawn_peers gives the new
    # processes' handles before they exist, and they must match theirs
    assert Handle("kid", 1, 2, "a1").encode() == Handle("kid", 1, 2, "a1").encode()


@pytest.mark.parametrize("text, says", [
    ("gloo:0:-1:0:", "not a handle of the spmd backend"),
    (42, "not a handle of the spmd backend"),
    ("spmd:{not json", "not a well-formed spmd handle"),
    ('spmd:{"w":"a","r":1}', "not a well-formed spmd handle"),
    ('spmd:{"w":"a","r":3,"n":3}', "says rank 3 of a world of 3"),
])
def test_what_is_not_a_handle_is_named(text, says):
    with pytest.raises(ValueError, match=rf"^reconfigure: handles\[2\] .*{says}"):
        Handle.decode(text, "handles[2]")


def test_a_list_orders_the_ranks_a_set_keeps_the_worlds_order():
    hs = world("a", 3)
    p = plan(hs[::-1], ordered=True)
    assert p.order == tuple(hs[::-1]) and p.base == "a" and p.base_kept == (0, 1, 2)
    assert p.steps(hs[0]) == [] and not p.spawned and not p.by_port
    p = plan(sorted(hs, key=lambda h: h.encode()), ordered=False)
    assert p.order == tuple(hs)


def test_fewer_of_a_world_shrink_it():
    hs = world("a", 4)
    p = plan([hs[0], hs[1], hs[3]], ordered=True)
    assert (p.base, p.base_size, p.base_kept) == ("a", 4, (0, 1, 3))
    assert [h.rank for h in p.order] == [0, 1, 3]


def test_spawned_processes_join_their_starting_world_by_its_link():
    a, kids = world("a", 2), world("kid", 2, parent="a")
    full = [a[0], kids[0], a[1], kids[1]]      # the new ones at ranks 1 and 3
    p = plan(full, ordered=True)
    assert (p.base, p.spawned) == ("a", "kid") and p.order == tuple(full)
    for h in a + kids:
        assert p.steps(h) == [("link", "kid")]
    # in a set (reconfigure sorts its strings): the starting world's ranks, then the new
    p = plan(sorted(full, key=Handle.encode), ordered=False)
    assert p.order == tuple(a + kids)


def test_other_worlds_join_through_their_rank_0s_port_in_order():
    a = world("a", 2, port="pa")
    b, c = world("b", 1, port="pb"), world("c", 2, port="pc")
    p = plan(a + b + c, ordered=True)
    assert p.base == "a" and p.by_port == (("b", "pb"), ("c", "pc"))
    assert p.steps(a[1]) == [("connect", "pb"), ("connect", "pc")]
    assert p.steps(b[0]) == [("accept", "pb"), ("connect", "pc")]
    assert p.steps(c[1]) == [("accept", "pc")]
    # the base is the largest world (the first of those), wherever its handles are
    p = plan(b + c + a, ordered=True)
    assert p.base == "c" and p.by_port == (("b", "pb"), ("a", "pa"))


def test_spawned_processes_and_a_port_world_in_one_reconfigure():
    a, kids, b = world("a", 2), world("kid", 1, parent="a"), world("b", 1, port="pb")
    p = plan(a + kids + b, ordered=True)
    assert p.steps(a[0]) == [("link", "kid"), ("connect", "pb")]
    assert p.steps(kids[0]) == [("link", "kid"), ("connect", "pb")]
    assert p.steps(b[0]) == [("accept", "pb")]


@pytest.mark.parametrize("handles, says", [
    (world("a", 2) + [Handle("a", 1, 2)], r"world a lists rank\(s\) \[1\] twice"),
    ([Handle("a", 0, 2), Handle("a", 1, 3)], "disagree on its size"),
    (world("a", 2)[:1] + world("kid", 1, parent="a"),
     r"1 of 2 handles of world a given \(shrink first"),
    (world("a", 2) + world("kid", 2, parent="a")[:1], "1 of 2 handles of world kid"),
    (world("kid", 1, parent="a"), "0 of .* handles of world a"),
    (world("a", 2) + world("k1", 1, parent="a") + world("k2", 1, parent="a"),
     "handles of 2 groups of processes spawn_peers started"),
    (world("a", 2) + world("b", 1), r"world b joins through its rank 0's port.*no port"),
    (world("a", 3) + world("b", 2, port="pb")[1:], r"world b .*: 1 handle\(s\) given"),
])
def test_handles_that_cannot_make_one_group_are_refused_before_anything_is_sent(handles, says):
    with pytest.raises(ValueError, match=says):
        plan(handles, ordered=True)
