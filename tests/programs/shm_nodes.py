"""The shared-memory engine across (pseudo-)nodes: run by tests/jobs/test_shm_nodes.py with
SPMD_PSEUDO_NODE_SIZE=k under mpiexec -n N (N a multiple of k), with the repository
and tests/ on PYTHONPATH.

Checks the hierarchical all_reduce (every dtype, op and layout; several chunks; the same
bits on every rank), groups whose nodes hold one rank each, groups the engine must
leave to MPI (nodes holding different numbers of their ranks), the other collectives
on multi-node groups (MPI's), and SPMD_SHM=auto picking the hierarchical path.
"""

import os
import time
from datetime import timedelta

import numpy as np
from programs.shm_checks import (
    check_all_reduce,
    check_movement,
    check_reduce,
    check_reduce_scatter,
    check_same_bits,
    engine_group,
    engine_of,
)

import spmd
from spmd.backends.shm import engine as shm
from spmd.core.arrays import bfloat16

DTYPES = [np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8,
                                np.uint16, np.uint32, np.uint64, np.float16, np.float32,
                                np.float64, np.complex64, np.complex128)]
if bfloat16 is not None:
    DTYPES.append(bfloat16)
FLOATS = [dt for dt in DTYPES if dt.kind == "f" or dt == bfloat16]
SHAPE = (5, 7)


def layout_of(pg):
    w = engine_of(pg)._win
    return (w.num_nodes, w.local_size) if w is not None else None


def main() -> None:
    k = int(os.environ["SPMD_PSEUDO_NODE_SIZE"])
    spmd.init_process_group(timeout=timedelta(seconds=120))
    n, me = spmd.get_world_size(), spmd.get_rank()
    nodes = n // k

    # WORLD: nodes x k, through 128-byte slots (several chunks per array).
    world = engine_group(spmd, list(range(n)), slot_bytes=128)
    check_all_reduce(spmd, world, DTYPES, shape=SHAPE)
    assert layout_of(world) == (nodes, k), layout_of(world)
    assert "hierarchical" in engine_of(world).describe()
    # Nodes sum in local-rank order; across two nodes MPI adds the two node sums, which
    # fixes the order completely (with more nodes MPI's own order applies).
    two_level = [list(range(i * k, i * k + k)) for i in range(nodes)] if nodes <= 2 else False
    check_same_bits(spmd, world, FLOATS, count=1001, ordered=two_level)
    # The other collectives of a multi-node group are MPI's.
    check_reduce(spmd, world, DTYPES[:6], shape=SHAPE)
    check_reduce_scatter(spmd, world, FLOATS, rows=3, in_place=False)
    check_movement(spmd, world, DTYPES[:3], rows=3, in_place=False)
    assert engine_of(world).broadcast_from > 1 << 40

    # Even and odd ranks: one or several ranks per node, or nodes holding different
    # numbers of them (then MPI runs it, and the status says why).
    halves = [list(range(0, n, 2)), list(range(1, n, 2))]
    parity = engine_group(spmd, split=halves, slot_bytes=128)
    check_all_reduce(spmd, parity, FLOATS + DTYPES[:2], shape=SHAPE)
    check_same_bits(spmd, parity, FLOATS, count=1001, ordered=False)
    mine = halves[me % 2]
    per_node = [sum(1 for r in mine if r // k == i) for i in range(nodes)]
    if len({c for c in per_node if c}) > 1:
        assert layout_of(parity) is None and "different numbers" in shm.status(parity.engine_for("cpu"))
    else:
        assert layout_of(parity) == (sum(1 for c in per_node if c), max(per_node))

    # One pseudo-node: the flat engine, one-shot (up to 128 bytes) and two-shot.
    local = engine_group(spmd, split=[list(range(i * k, i * k + k)) for i in range(nodes)],
                         slot_bytes=128)
    check_all_reduce(spmd, local, FLOATS, shape=SHAPE)
    assert layout_of(local) == (1, k)

    # SPMD_SHM=auto: small arrays go to MPI, and so do the medium ones once the engine
    # knows the group spans nodes; from ACROSS_NODES.all_reduce_from the engine all-reduces hierarchically.
    os.environ["SPMD_SHM"] = "auto"
    auto = spmd.new_group(list(range(n)))
    x = np.ones(8, np.float32)
    spmd.all_reduce(x, group=auto)
    assert engine_of(auto)._win is None and x[0] == n
    for items in (3 * shm.SLOT_BYTES // 4 + 5, shm.ACROSS_NODES.all_reduce_from // 4):
        big = np.full(items, 1.0 + me, np.float32)
        spmd.all_reduce(big, group=auto)
        np.testing.assert_array_equal(big, np.full(items, n + n * (n - 1) / 2, np.float32))
        assert layout_of(auto) == (nodes, k)
        assert (engine_of(auto)._win.seq > 0) == (big.nbytes >= shm.ACROSS_NODES.all_reduce_from)
    del big

    # Ops queued while the set-up is pending, which it then leaves to MPI (the group
    # spans nodes), keep their order among the ops started on MPI meanwhile, even where
    # the ranks reach them at different times.
    order = spmd.new_group(list(range(n)))
    engine = order.engine_for("cpu").shm
    assert engine is not None and engine._win is None
    rows = engine.reduce_scatter_from // 4 // n + 1
    src = np.full(n * rows, me + 1, np.int32)
    mine = np.empty(rows, np.int32)
    assert src.nbytes >= engine.reduce_scatter_from
    work = spmd.reduce_scatter_tensor(mine, src, group=order, async_op=True)
    if me % 2 == 0:  # make the ranks reach the next op at different times
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            work.is_completed()
            time.sleep(0.01)
    small = np.array([me + 1], np.int64)
    spmd.all_reduce(small, group=order)
    work.wait()
    assert small[0] == n * (n + 1) // 2, small
    np.testing.assert_array_equal(mine, np.full(rows, n * (n + 1) // 2, np.int32))
    assert engine.reduce_scatter_from > src.nbytes  # later ones go straight to MPI
    spmd.destroy_process_group(order)

    for pg in (auto, local, parity, world):
        spmd.destroy_process_group(pg)
    print(f"rank {me} shm nodes OK", flush=True)
    spmd.destroy_process_group()


if __name__ == "__main__":
    main()
