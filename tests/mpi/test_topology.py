"""Node topology: node-local and cross-node groups, pseudo-nodes (SPMD_PSEUDO_NODE_SIZE),
and choosing a GPU per rank."""


import layout_ref as ref
import numpy as np
import pytest
from conftest import TEST_TIMEOUT

from spmd.layouts import topology

ENV = topology.PSEUDO_NODE_ENV


def _sum_of_ranks(dist, pg):
    x = np.array([dist.get_rank()], np.int64)
    dist.all_reduce(x, group=pg)
    return int(x[0])


def _free(dist, topo):
    dist.destroy_process_group(topo.node_group)
    dist.destroy_process_group(topo.cross_node_group)


@pytest.mark.mpi
def test_one_host(dist, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    me, n = dist.get_rank(), dist.get_world_size()
    topo = dist.node_topology()
    assert (topo.local_rank, topo.local_size, topo.node_rank, topo.num_nodes) == (me, n, 0, 1)
    assert topo.node_ranks == list(range(n)) and topo.cross_node_group.ranks == [me]
    assert _sum_of_ranks(dist, topo.node_group) == sum(range(n))
    _free(dist, topo)


@pytest.mark.mpi
@pytest.mark.parametrize("k", [1, 2, 3])
def test_pseudo_nodes(dist, monkeypatch, k):
    monkeypatch.setenv(ENV, str(k))
    me, n = dist.get_rank(), dist.get_world_size()
    nodes, cross = ref.pseudo_node_groups(n, k)
    topo = dist.node_topology()
    assert topo.node_group.ranks == ref.group_of(nodes, me)
    assert topo.cross_node_group.ranks == ref.group_of(cross, me)
    assert (topo.local_rank, topo.local_size) == (me % k, len(ref.group_of(nodes, me)))
    assert (topo.node_rank, topo.num_nodes) == (me // k, len(nodes))
    assert _sum_of_ranks(dist, topo.node_group) == sum(ref.group_of(nodes, me))
    assert _sum_of_ranks(dist, topo.cross_node_group) == sum(ref.group_of(cross, me))
    comm = topology.split_node(dist.GroupMember.WORLD.comm)
    assert comm.Get_size() == len(ref.group_of(nodes, me))
    comm.Free()
    # (node rank, node size, host size): every rank of these tests runs on this host
    assert topology.node_layout(dist.GroupMember.WORLD.comm) == (me % k, topo.local_size, n)
    _free(dist, topo)


@pytest.mark.mpi
def test_pseudo_nodes_of_a_subgroup(dist, monkeypatch):
    monkeypatch.setenv(ENV, "2")
    me, n = dist.get_rank(), dist.get_world_size()
    halves = [list(range(0, n, 2))] + ([list(range(1, n, 2))] if n > 1 else [])
    parity = dist.split_group(split_ranks=halves, group_desc="parity")
    nodes, _ = ref.pseudo_node_groups(n, 2)
    topo = dist.node_topology(parity)
    # nodes are those of the world, restricted to the members of the subgroup
    assert topo.node_group.ranks == [r for r in ref.group_of(nodes, me) if r % 2 == me % 2]
    _free(dist, topo)
    dist.destroy_process_group(parity)


@pytest.mark.mpi
def test_world_local_rank_follows_pseudo_nodes(dist, monkeypatch):
    me, n = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    monkeypatch.setenv(ENV, "2")
    dist.init_process_group(timeout=TEST_TIMEOUT)
    try:
        assert dist.get_node_local_rank() == me % 2
    finally:
        dist.destroy_process_group()
        monkeypatch.delenv(ENV)
        dist.init_process_group(timeout=TEST_TIMEOUT)
    assert dist.get_node_local_rank() == me and n >= 1


@pytest.mark.mpi
def test_bind_device_uses_node_local_rank(dist, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert dist.bind_device(device_count=3, set_current=False) == dist.get_node_local_rank() % 3
