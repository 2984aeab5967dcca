"""init/destroy, ranks and sizes, Backend strings, errors before init."""

from datetime import timedelta

import numpy as np
import pytest
from conftest import TEST_TIMEOUT
from mpi4py import MPI

pytestmark = pytest.mark.mpi


def test_world_is_private_duplicate(dist):
    pg = dist.GroupMember.WORLD
    assert dist.group.WORLD is pg
    assert pg.comm != MPI.COMM_WORLD
    assert MPI.Comm.Compare(pg.comm, MPI.COMM_WORLD) == MPI.CONGRUENT
    assert dist.get_rank() == MPI.COMM_WORLD.Get_rank() == pg.rank()
    assert dist.get_world_size() == MPI.COMM_WORLD.Get_size() == pg.size()
    assert pg.ranks == list(range(pg.size()))
    assert dist.get_backend() == "mpi" and dist.get_backend(pg) == dist.Backend.MPI
    assert dist.is_initialized() and dist.is_available() and dist.is_mpi_available()


def test_user_comm_world_traffic_does_not_mix(dist):
    """A user message on COMM_WORLD is not matched by spmd's receive on WORLD."""
    me, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        pytest.skip("needs two ranks")
    if me == 0:
        MPI.COMM_WORLD.Send(np.array([1.0]), dest=1, tag=0)
        dist.send(np.array([2.0]), dst=1)
    elif me == 1:
        buf = np.zeros(1)
        dist.recv(buf, src=0)
        assert buf[0] == 2.0
        MPI.COMM_WORLD.Recv(buf, source=0, tag=0)
        assert buf[0] == 1.0


def test_destroy_and_init_again(dist):
    me, n = dist.get_rank(), dist.get_world_size()
    sub = dist.new_group([0])
    dist.destroy_process_group()
    assert not dist.is_initialized()
    assert dist.GroupMember.WORLD is None
    with pytest.raises(RuntimeError, match=r"call spmd.init_process_group\(\) first"):
        dist.all_reduce(np.zeros(1))
    with pytest.raises(RuntimeError, match=r"init_process_group\(\)"):
        dist.get_rank()
    with pytest.raises(RuntimeError, match=r"init_process_group\(\)"):
        dist.new_group([0])
    if me == 0:
        with pytest.raises(RuntimeError, match="destroyed"):
            dist.all_reduce(np.zeros(1), group=sub)
    dist.init_process_group(timeout=TEST_TIMEOUT, world_size=n, rank=me)
    x = np.ones(2)
    dist.all_reduce(x)
    np.testing.assert_array_equal(x, [n, n])


def test_double_init_raises(dist):
    with pytest.raises(RuntimeError, match="twice"):
        dist.init_process_group()


def test_init_argument_checks(dist):
    me, n = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    try:
        with pytest.raises(ValueError, match=f"world_size={n + 1} but MPI started {n}"):
            dist.init_process_group(world_size=n + 1)
        with pytest.raises(ValueError, match=f"rank={me + 1} but MPI says this is rank {me}"):
            dist.init_process_group(rank=me + 1)
        with pytest.raises(ValueError, match="unknown backend 'ucc'"):
            dist.init_process_group(backend="ucc")
        with pytest.raises(ValueError, match="timeout"):
            dist.init_process_group(timeout=timedelta(seconds=-1))
        assert not dist.is_initialized()
        with pytest.warns(UserWarning, match="init_method='tcp://h:1' is ignored"):
            dist.init_process_group(init_method="tcp://h:1", timeout=TEST_TIMEOUT)
    finally:
        if not dist.is_initialized():
            dist.init_process_group(timeout=TEST_TIMEOUT)
    assert dist.GroupMember.WORLD.timeout == TEST_TIMEOUT


def test_backend_strings():
    import spmd

    assert spmd.Backend("MPI") == "mpi"
    assert spmd.Backend.device_map("mpi") == {"cpu": "mpi", "cuda": "mpi"}
    assert spmd.Backend.device_map("gloo") == {"cpu": "mpi"}
    assert spmd.Backend.device_map("nccl") == {"cuda": "nccl"}
    assert spmd.Backend.device_map("cpu:mpi,cuda:nccl") == {"cpu": "mpi", "cuda": "nccl"}
    for bad in ("cpu:mpi,cpu:nccl", "tpu:mpi", "cpu=mpi", ""):
        with pytest.raises(ValueError):
            spmd.Backend(bad)
    with pytest.raises(TypeError):
        spmd.Backend(3)


def test_nccl_backend_unavailable_is_a_clear_error(dist):
    if dist.is_nccl_available():
        pytest.skip("a NCCL backend is registered here")
    dist.destroy_process_group()
    try:
        with pytest.raises(RuntimeError, match="backend 'nccl' for cuda arrays is not available"):
            dist.init_process_group(backend="nccl")
    finally:
        dist.init_process_group(timeout=TEST_TIMEOUT)


def test_gloo_alias_runs_on_mpi(dist):
    dist.destroy_process_group()
    dist.init_process_group(backend="gloo", timeout=TEST_TIMEOUT)
    try:
        x = np.ones(1)
        dist.all_reduce(x)
        assert x[0] == dist.get_world_size()
    finally:
        dist.destroy_process_group()
        dist.init_process_group(timeout=TEST_TIMEOUT)


def test_node_local_rank(dist):
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        assert dist.get_node_local_rank() == node.Get_rank()
    finally:
        node.Free()


def test_node_local_rank_before_init(dist, monkeypatch):
    dist.destroy_process_group()
    try:
        for var in ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK",
                    "PMI_LOCAL_RANK", "SLURM_LOCALID"):
            monkeypatch.delenv(var, raising=False)
        assert dist.get_node_local_rank(fallback_rank=7) == 7
        with pytest.raises(RuntimeError, match="fallback_rank"):
            dist.get_node_local_rank()
        monkeypatch.setenv("SLURM_LOCALID", "3")
        assert dist.get_node_local_rank() == 3
    finally:
        dist.init_process_group(timeout=TEST_TIMEOUT)


def test_destroying_a_destroyed_group_is_a_no_op(dist):
    """As in torch: a group destroyed (also by destroying WORLD) can be destroyed again,
    so fixtures that clean up after a test that re-initialised spmd do not fail."""
    sub = dist.new_group(list(range(dist.get_world_size())))
    dist.destroy_process_group(sub)
    dist.destroy_process_group(sub)
    other, _ = dist.new_subgroups(group_size=1)
    dist.destroy_process_group()  # WORLD and every group with it
    dist.init_process_group(timeout=TEST_TIMEOUT)
    dist.destroy_process_group(other)
    with pytest.raises(RuntimeError, match="destroyed"):
        dist.all_reduce(np.zeros(1), group=other)
    x = np.ones(1)
    dist.all_reduce(x)
    assert x[0] == dist.get_world_size()


class _FakeCupy:
    """Records which device spmd makes current (the selection logic is spmd's)."""

    def __init__(self):
        fake = self
        self.current = 0

        class Device:
            def __init__(self, index):
                self.id = index

            def use(self):
                fake.current = self.id

        self.cuda = type("cuda", (), {
            "Device": Device,
            "runtime": type("runtime", (), {"getDevice": staticmethod(lambda: fake.current)}),
        })


def test_device_id_becomes_the_current_device(dist, monkeypatch):
    from spmd.core import cuda as _gpu

    me, n = dist.get_rank(), dist.get_world_size()
    fake = _FakeCupy()
    monkeypatch.setattr(_gpu, "cupy_or_none", lambda: fake)
    dist.destroy_process_group()
    try:
        dist.init_process_group(backend="mpi", device_id=f"cuda:{n - 1 - me}",
                                timeout=TEST_TIMEOUT)
        assert fake.current == n - 1 - me  # arrays made from now on land there
        assert _gpu.bound_device() == n - 1 - me
        dist.destroy_process_group()
        fake.current = 5
        dist.init_process_group(backend="mpi", device_id="cuda", timeout=TEST_TIMEOUT)
        assert fake.current == 5 and _gpu.bound_device() == 5  # no index: CuPy's current
        dist.destroy_process_group()
        dist.init_process_group(backend="mpi", timeout=TEST_TIMEOUT)
        assert fake.current == 5
    finally:
        monkeypatch.undo()
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group(timeout=TEST_TIMEOUT)
