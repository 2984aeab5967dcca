"""Traces: one Chrome-trace event per op with group, size and sequence number; the
per-rank files merge into one."""

import json
import os

import numpy as np
import pytest

from spmd.tools import trace

pytestmark = pytest.mark.mpi


def _shared_dir(dist, tmp_path):
    """Rank 0's tmp_path, known to every rank (one node: the same file system)."""
    obj = [str(tmp_path)]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def test_one_event_per_op_and_merge(dist, tmp_path, groups):
    n, rank = dist.get_world_size(), dist.get_rank()
    folder = _shared_dir(dist, tmp_path)
    pattern = os.path.join(folder, "t-%r.json")
    # Backends set themselves up on a group's first op (which a trace would show too).
    dist.all_reduce(np.ones(2), group=groups["parity"])
    dist.all_reduce(np.ones(2))
    dist.barrier()
    with trace.start(pattern) as t:
        assert trace.is_tracing()
        for _ in range(3):
            dist.all_reduce(np.ones(4, np.float32))
        dist.broadcast(np.zeros((2, 3), np.int64), src=0)
        dist.all_reduce(np.ones(2), group=groups["parity"])
        dist.barrier()
        path = t.path
    assert not trace.is_tracing()
    assert path == os.path.join(folder, f"t-{rank}.json")
    with open(path) as f:
        doc = json.load(f)
    ops = ("all_reduce", "broadcast", "barrier")
    events = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] in ops]
    assert [e["name"] for e in events] == ["all_reduce"] * 3 + ["broadcast", "all_reduce",
                                                                "barrier"]
    world = [e["args"]["seq"] for e in events if e["args"]["group"] == "WORLD"]
    assert world == list(range(world[0], world[0] + 5))
    assert events[0]["args"]["bytes"] == 16 and events[0]["args"]["shape"] == [4]
    assert events[0]["args"]["dtype"] == "float32" and events[0]["args"]["group_size"] == n
    assert events[3]["args"]["bytes"] == 48 and events[3]["args"]["shape"] == [2, 3]
    assert events[4]["args"]["group"] == groups["parity"].name
    assert events[4]["tid"] != events[0]["tid"]
    assert all(e["pid"] == rank and e["dur"] >= 0 and e["cat"] == "collective" for e in events)
    assert all(a["ts"] <= b["ts"] for a, b in zip(events, events[1:]))
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"group WORLD", f"group {groups['parity'].name}"}
    assert doc["otherData"]["rank"] == rank and doc["otherData"]["world_size"] == n

    dist.barrier()
    if rank == 0:
        files = [os.path.join(folder, f"t-{r}.json") for r in range(n)]
        out = os.path.join(folder, "job.json")
        merged = trace.merge(list(reversed(files)), out, align=True)
        with open(out) as f:
            assert json.load(f) == merged
        xs = [e for e in merged["traceEvents"] if e["ph"] == "X" and e["name"] in ops]
        assert len(xs) == 6 * n
        assert sorted({e["pid"] for e in xs}) == list(range(n))
        assert merged["otherData"]["ranks"] == list(range(n))
        assert all(a["ts"] <= b["ts"] for a, b in zip(xs, xs[1:]))
    dist.barrier()


def test_p2p_numbered_separately(dist, tmp_path):
    n, rank = dist.get_world_size(), dist.get_rank()
    if n < 2:
        pytest.skip("needs two ranks")
    with trace.start(os.path.join(str(tmp_path), "p2p.json")) as t:
        dist.barrier()
        if rank < 2:
            x = np.zeros(3)
            for _ in range(2):
                if rank == 0:
                    dist.send(x, dst=1)
                else:
                    dist.recv(x, src=0)
        dist.barrier()
        path = t.path
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    # The flight recorder's numbers: consecutive, and the same on every rank of the group.
    coll = [e["args"]["seq"] for e in events if e["cat"] == "collective"]
    assert len(coll) == 2 and coll[1] == coll[0] + 1, coll
    seen = [None] * n
    dist.all_gather_object(seen, coll)
    assert all(c == coll for c in seen), seen
    p2p = [e for e in events if e["cat"] == "p2p"]
    if rank < 2:
        assert [e["name"] for e in p2p] == ["send", "send"] if rank == 0 else ["recv", "recv"]
        p2p_seq = [e["args"]["seq"] for e in p2p]
        assert p2p_seq[1] == p2p_seq[0] + 1, p2p_seq
        assert all(e["args"]["bytes"] == 24 for e in p2p)
    else:
        assert p2p == []


def test_expand_path_and_errors(tmp_path):
    assert trace.expand_path("a-%r.json", 3, 4) == "a-3.json"
    assert trace.expand_path("a.json", 3, 4) == "a.rank3.json"
    assert trace.expand_path("a.json", 0, 1) == "a.json"
    assert trace.expand_path("x%%-%r", 1, 2) == "x%-1"
    assert trace.expand_path("p%p", 0, 1) == f"p{os.getpid()}"
    with trace.start(str(tmp_path / "x.json")):
        with pytest.raises(RuntimeError, match="already tracing"):
            trace.start(str(tmp_path / "y.json"))
    assert trace.stop() is None
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a Chrome trace"):
        trace.merge([str(bad)])
    with pytest.raises(ValueError, match="no input files"):
        trace.merge([])
