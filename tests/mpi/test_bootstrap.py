"""Start-up exchanges through a store passed to init_process_group, and the check that
every rank runs the same installation."""

import numpy as np
import pytest
from conftest import TEST_TIMEOUT

pytestmark = pytest.mark.mpi


def _file_store(dist, tmp_path_factory):
    # one path for every rank: rank 0 picks it, the others learn it over MPI
    from mpi4py import MPI

    from spmd.store import FileStore

    path = str(tmp_path_factory.mktemp("store") / "init") if dist.get_rank() == 0 else None
    path = MPI.COMM_WORLD.bcast(path, 0)
    return FileStore(path, dist.get_world_size())


def _recording(store):
    """Remember the keys this rank sets (the store is real; only its set is watched)."""
    written = []
    real_set = store.set

    def set_and_record(key, value):
        written.append(key)
        real_set(key, value)

    store.set = set_and_record
    return written


def test_init_with_store_uses_it(dist, tmp_path_factory):
    n, me = dist.get_world_size(), dist.get_rank()
    store = _file_store(dist, tmp_path_factory)
    written = _recording(store)
    dist.destroy_process_group()
    try:
        dist.init_process_group(store=store, timeout=TEST_TIMEOUT)
        if n > 1:  # the installation check: one key per rank, and rank 0's verdict
            assert any(k.endswith(f"/installation/{me}") for k in written), written
            assert any(k.endswith("/installation-verdict") for k in written) == (me == 0)
        dist.barrier()
        assert store.num_keys() == 0  # every key is deleted once read
        x = np.ones(1)
        dist.all_reduce(x)
        assert x[0] == n
    finally:
        dist.destroy_process_group()
        dist.init_process_group(timeout=TEST_TIMEOUT)
        store.close()


@pytest.mark.parametrize("via_store", [False, True])
def test_mixed_installations_are_refused(dist, tmp_path_factory, monkeypatch, via_store):
    from spmd.runtime import world

    n, me = dist.get_world_size(), dist.get_rank()
    if n == 1:
        pytest.skip("needs two ranks to disagree")
    store = _file_store(dist, tmp_path_factory) if via_store else None
    real = world._installation
    monkeypatch.setattr(world, "_installation",
                        lambda: {**real(), "spmd": "9.9" if me == n - 1 else real()["spmd"]})
    dist.destroy_process_group()
    try:
        with pytest.raises(RuntimeError, match=rf"rank {n - 1} runs a different installation "
                           r"than rank 0: spmd '0\.1\.0' on rank 0 vs '9\.9'"):
            dist.init_process_group(store=store, timeout=TEST_TIMEOUT)
        assert not dist.is_initialized()
    finally:
        monkeypatch.setattr(world, "_installation", real)
        dist.init_process_group(timeout=TEST_TIMEOUT)
        if store is not None:
            store.close()


def test_store_keys_never_repeat(dist):
    """Keys name the members and a sequence number the members agree on: a re-created
    group, or another group with the same members, never reads an old group's key."""
    from types import SimpleNamespace

    from mpi4py import MPI

    from spmd.backends.bootstrap import _key

    n = dist.get_world_size()
    keys = []
    for _ in range(2):  # the same members, twice, alive together
        pg = dist.new_group(list(range(n)))
        keys.append(_key(pg.context, "nccl-unique-id"))
        keys.append(_key(pg.context, "nccl-unique-id"))  # the group's second exchange
    dist.destroy_process_group(pg)
    again = dist.new_group(list(range(n)))  # re-created after a destroy
    keys.append(_key(again.context, "nccl-unique-id"))
    assert len(set(keys)) == len(keys), keys
    # every member computed the same keys
    assert MPI.COMM_WORLD.allgather(keys) == [keys] * n
    dist.destroy_process_group(again)
    # big groups: the whole member list counts, not the first rank and the size
    big = [SimpleNamespace(comm=MPI.COMM_SELF, ranks=tuple(r), size=len(r),
                           bootstrap_count=0)
           for r in (range(20), [0, *range(2, 21)])]
    for pg in big:
        pg.bootstrap_seq = 7  # the same sequence number: only the members differ
    assert _key(big[0], "x") != _key(big[1], "x")


@pytest.mark.parametrize("via_store", [False, True])
def test_two_ranks_on_one_gpu_are_refused_before_nccl(dist, tmp_path_factory, via_store):
    """The duplicate-GPU check over the group, with each rank's (host, bus id) given:
    the same verdict on every rank, naming the ranks and the fixes."""
    from spmd.backends.bootstrap import check_distinct_gpus

    n, me = dist.get_world_size(), dist.get_rank()
    store = _file_store(dist, tmp_path_factory) if via_store else None
    world = dist.GroupMember.WORLD.context
    try:
        # one GPU each, or NCCL_HOSTID making each rank its own host: accepted
        check_distinct_gpus(world, store, "node1", f"0000:{me:02x}:00.0", "all_reduce")
        check_distinct_gpus(world, store, f"NCCL_HOSTID=r{me}", "0000:01:00.0", "all_reduce")
        if n == 1:
            return
        # the last rank shares rank 0's GPU
        bus = f"0000:{0 if me == n - 1 else me:02x}:00.0"
        with pytest.raises(RuntimeError, match=rf"all_reduce: group ranks 0 and {n - 1} "
                           rf"\(global ranks 0 and {n - 1}\) would share one GPU \(PCI bus "
                           r"0000:00:00\.0 on host 'node1'\).*Duplicate GPU detected.*"
                           r"backend='cpu:mpi,cuda:mpi'.*NCCL_HOSTID.*\[rank \d+, group WORLD\]"):
            check_distinct_gpus(world, store, "node1", bus, "all_reduce")
        if store is not None:
            dist.barrier()
            assert store.num_keys() == 0
    finally:
        if store is not None:
            store.close()


def test_duplicate_gpus_rule():
    from spmd.backends.bootstrap import duplicate_gpus

    assert duplicate_gpus([("a", "1"), ("b", "1"), ("a", "2")], [4, 5, 6]) == ""
    why = duplicate_gpus([("a", "1"), ("b", "1"), ("a", "2"), ("b", "1")], [4, 5, 6, 7])
    assert why.startswith("group ranks 1 and 3 (global ranks 5 and 7) would share one GPU")
