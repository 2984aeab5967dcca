"""Node topology without a job: SPMD_PSEUDO_NODE_SIZE parsing, visible GPU counts and
choosing a GPU per rank (the groups: tests/mpi/test_topology.py)."""


import pytest

from spmd.layouts import topology

ENV = topology.PSEUDO_NODE_ENV


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_bad_pseudo_node_size(value):
    with pytest.raises(ValueError, match=rf"{ENV}='{value}' is not a valid setting: expected "
                       r"(a positive integer|an integer)"):
        topology.pseudo_node_size({ENV: value})


def test_pseudo_node_size_unset_or_empty():
    assert topology.pseudo_node_size({}) is None
    assert topology.pseudo_node_size({ENV: " "}) is None
    assert topology.pseudo_node_size({ENV: "4"}) == 4


@pytest.mark.parametrize("mask, count", [
    (None, 4), ("", 0), ("-1", 0), ("2,3", 2), ("0,1,-1,2", 2), ("GPU-aa,GPU-bb", 2),
    ("0,1,2,3,4,5", 4), ("1,,2", 1),
])
def test_visible_device_count(monkeypatch, mask, count):
    monkeypatch.setattr(topology, "_physical_gpus", lambda: 4)
    env = {} if mask is None else {"CUDA_VISIBLE_DEVICES": mask}
    assert topology.visible_device_count(env) == count


def test_visible_device_count_without_driver(monkeypatch):
    monkeypatch.setattr(topology, "_physical_gpus", lambda: 0)
    assert topology.visible_device_count({}) == 0
    assert topology.visible_device_count({"CUDA_VISIBLE_DEVICES": "0,1"}) == 2


def test_bind_device():
    assert [topology.bind_device(r, device_count=4, set_current=False) for r in range(6)] == \
        [0, 1, 2, 3, 0, 1]
    assert topology.bind_device(3, device_count=0) is None
    with pytest.raises(ValueError, match="local_rank must be a non-negative int, got -1"):
        topology.bind_device(-1, device_count=2)
    with pytest.raises(ValueError, match="device_count must be a non-negative int, got True"):
        topology.bind_device(0, device_count=True)
