"""The comms logger: exact counts and bytes for a known sequence of ops, the summary
table and dict, and that it records nothing (and is not registered) when off."""

import io

import numpy as np
import pytest

from spmd.core import work
from spmd.tools import comms_log

pytestmark = pytest.mark.mpi


@pytest.fixture
def fresh_log(dist):
    comms_log.disable()
    comms_log.reset()
    yield comms_log
    comms_log.disable()
    comms_log.reset()


def _known_sequence(dist):
    n = dist.get_world_size()
    for _ in range(3):
        dist.all_reduce(np.ones(10, np.float32))                   # 40 B
    for _ in range(2):
        dist.broadcast(np.zeros(7, np.int64), src=0)               # 56 B
    dist.all_gather_into_tensor(np.zeros(3 * n), np.ones(3))       # 24*n B (gathered size)
    dist.reduce_scatter_tensor(np.zeros(2), np.ones(2 * n))        # 16*n B (input size)
    dist.all_reduce(np.ones(5, np.int8), async_op=True).wait()     # 5 B
    dist.barrier()                                                 # 0 B


def test_off_by_default(fresh_log, dist):
    assert not comms_log.is_enabled()
    assert comms_log.logger not in work.observers
    _known_sequence(dist)
    assert comms_log.stats() == {}


def test_counts_and_bytes_exact(fresh_log, dist):
    n = dist.get_world_size()
    with comms_log.enable():
        assert comms_log.is_enabled()
        _known_sequence(dist)
    assert not comms_log.is_enabled()
    stats = comms_log.stats()
    counts = {(key.op, key.nbytes): timing.calls for key, timing in stats.items()}
    assert counts == {
        ("all_reduce", 40): 3,
        ("broadcast", 56): 2,
        ("all_gather_into_tensor", 24 * n): 1,
        ("reduce_scatter_tensor", 16 * n): 1,
        ("all_reduce", 5): 1,
        ("barrier", 0): 1,
    }
    for key, timing in stats.items():
        assert key.group_size == n
        assert 0 <= timing.min_s <= timing.max_s and timing.total_s >= timing.min_s * timing.calls
        assert tuple(timing) == (timing.calls, timing.total_s, timing.min_s, timing.max_s)


def test_summary_dict_and_table(fresh_log, dist):
    n = dist.get_world_size()
    with comms_log.enable():
        _known_sequence(dist)
    d = comms_log.summary(as_dict=True)
    assert d["all_reduce"][40]["count"] == 3
    assert d["all_reduce"][40]["total_bytes"] == 120
    assert d["broadcast"][56]["count"] == 2
    assert d["all_gather_into_tensor"][24 * n]["ranks"] == n
    row = d["all_reduce"][40]
    assert 0 <= row["slowest_rank"] < n
    assert row["slowest_avg_us"] >= row["avg_us"] * (1 - 1e-9)
    assert row["min_us"] <= row["max_us"]
    if n > 1:
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * (n - 1) / n)
    buf = io.StringIO()
    text = comms_log.summary(file=buf)
    assert text.splitlines()[0].startswith(f"spmd comms log: {n} rank(s)")
    assert any(line.startswith("all_reduce ") and "40 B" in line for line in text.splitlines())
    assert buf.getvalue().strip() == (text if dist.get_rank() == 0 else "")


def test_subgroup_ops_are_labelled(fresh_log, dist, groups):
    pg = groups["parity"]
    with comms_log.enable():
        dist.all_reduce(np.ones(4, np.float64), group=pg)
    d = comms_log.summary(as_dict=True)
    sizes = {pg.size()}
    labels = [k for k in d if k.startswith("all_reduce")]
    # every rank sees the labels of both halves; a half of the world's size is plain
    assert labels and all(k == "all_reduce" or k.startswith("all_reduce (n=") for k in labels)
    assert any(d[k][32]["ranks"] in sizes for k in labels)


def test_format_size():
    assert comms_log.format_size(8) == "8 B"
    assert comms_log.format_size(1024) == "1 KiB"
    assert comms_log.format_size(1536) == "1.5 KiB"
    assert comms_log.format_size(64 * 1024**2) == "64 MiB"
