"""The data path of host ops goes down through spmd's files: no file calls back into a
file that called it (see tests/_call_graph.py), through the compiled path, the blocking
path, the MPI engine's Work and the shared-memory engine."""

import numpy as np
import pytest
from _call_graph import cycle, file_calls
from programs.shm_checks import engine_group

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("items", [4, 1 << 16])
def test_host_all_reduce_goes_down(dist, items):
    x = np.ones(items, np.float32)
    dist.all_reduce(x)  # the first call sets things up (window, plans)
    def blocking():
        dist.all_reduce(x)

    def waited():
        dist.all_reduce(x, async_op=True).wait()

    for call in (blocking, waited):
        x[...] = 1
        edges = file_calls(call)
        assert cycle(edges) is None, (cycle(edges), sorted(edges))
        np.testing.assert_array_equal(x, np.full(items, dist.get_world_size(), np.float32))


def test_shm_ops_go_down(dist):
    n = dist.get_world_size()
    g = engine_group(dist, list(range(n)), slot_bytes=128, one_shot_max=0)
    x = np.ones(1000, np.float64)
    dist.all_reduce(x, group=g)
    x[...] = 1
    outs = [np.empty(1000, np.float64) for _ in range(n)]

    def ops():
        dist.all_reduce(x, group=g)
        dist.broadcast(x, 0, group=g)
        dist.all_gather(outs, x, group=g)

    edges = file_calls(ops)
    assert cycle(edges) is None, (cycle(edges), sorted(edges))
    assert ("api/collectives.py", "backends/host.py") in edges or n == 1, sorted(edges)
    for o in outs:
        np.testing.assert_array_equal(o, np.full(1000, n, np.float64))
