"""The data path of NCCL ops goes down through spmd's files (see tests/_call_graph.py):
the engine says what to enqueue, the communicator where and when; no file calls back
into one that called it."""

import numpy as np
import pytest
from _call_graph import cycle, file_calls
from _gpu_helpers import nccl_ranks_skip_reason

pytestmark = pytest.mark.mpi


def test_nccl_ops_go_down(dist):
    n, r = dist.get_world_size(), dist.get_rank()
    why = nccl_ranks_skip_reason(n)
    if why is not None:
        pytest.skip(why)
    from spmd.core import cuda

    cp = cuda.cupy_or_none()
    pg = dist.new_group(list(range(n)), backend="cpu:mpi,cuda:nccl")
    x = cp.ones(1000, cp.float32)
    dist.all_reduce(x, group=pg)  # the first call makes the communicator
    outs = [cp.empty(1000, cp.float32) for _ in range(n)]
    got = cp.empty(1000, cp.float32)

    def ops():
        x[...] = 1
        dist.all_reduce(x, group=pg)
        dist.all_gather(outs, x, group=pg)
        if n > 1:
            ops = [dist.P2POp(dist.isend, x, (r + 1) % n, group=pg),
                   dist.P2POp(dist.irecv, got, (r - 1) % n, group=pg)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        cp.cuda.get_current_stream().synchronize()

    edges = file_calls(ops)
    assert cycle(edges) is None, (cycle(edges), sorted(edges))
    into_engine = {a for a, b in edges if b == "backends/nccl/engine.py"}
    # the public ops enter the engine through its run (which puts a blocking call on the
    # caller's stream); batches of sends and receives, and the engine's making, come from
    # p2p and the group
    assert into_engine <= {"api/collectives.py", "api/p2p.py", "runtime/group.py"}, \
        sorted(edges)
    assert ("api/collectives.py", "backends/nccl/engine.py") in edges
    assert ("backends/nccl/engine.py", "backends/nccl/communicator.py") in edges
    for o in outs:
        np.testing.assert_array_equal(cp.asnumpy(o), np.full(1000, n, np.float32))
    if n > 1:
        np.testing.assert_array_equal(cp.asnumpy(got), np.full(1000, n, np.float32))
    dist.destroy_process_group(pg)
