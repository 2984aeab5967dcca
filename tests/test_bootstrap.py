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


def test_init_with_store_uses_it(dist, tmp_path_factory):
    n = dist.get_world_size()
    store = _file_store(dist, tmp_path_factory)
    dist.destroy_process_group()
    try:
        dist.init_process_group(store=store, timeout=TEST_TIMEOUT)
        # the installation check wrote one key per rank plus the verdict
        assert store.num_keys() >= n + 1
        x = np.ones(1)
        dist.all_reduce(x)
        assert x[0] == n
    finally:
        dist.destroy_process_group()
        dist.init_process_group(timeout=TEST_TIMEOUT)
        store.close()


@pytest.mark.parametrize("via_store", [False, True])
def test_mixed_installations_are_refused(dist, tmp_path_factory, monkeypatch, via_store):
    from spmd import world

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
