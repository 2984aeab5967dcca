"""Shrinking the default group (a planned removal, on the suite's MPI): the stayers get
the new default group with renumbered ranks, the old groups end, and what is built on a
group follows: parallel_state rebuilt, a BucketReducer and a checkpoint on the new world;
and torch's own ``dist.shrink_group`` on the "spmd" backend."""

from __future__ import annotations

import json
import sys

import pytest
from _launch import mpiexec, run


@pytest.mark.timeout(150)
def test_shrinking_world_rebuilds_what_hangs_off_it(tmp_path):
    proc = run(mpiexec(4, sys.executable, "tests/programs/shrink_world.py",
                       str(tmp_path / "ckpt")), timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, out
    results = sorted((json.loads(line[7:]) for line in out.splitlines()
                      if line.startswith("RESULT ")), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1], out
    for r in results:
        assert r == {"rank": r["rank"], "new_rank": r["rank"], "new_size": 2,
                     "is_default": True, "layout_dropped": True, "old_tp": "RuntimeError",
                     "tp": 2, "dp": 1, "tp_sum_ok": True, "reducer_ok": True,
                     "mesh": [[1, 2], True], "ckpt_ok": True}, out


TORCH_SHRINK = r"""
import os, sys, torch, torch.distributed as dist
dist.init_process_group("spmd")
r, n = dist.get_rank(), dist.get_world_size()
sub = dist.new_group(list(range(n - 1)))
t = torch.full((3,), r + 1.0); dist.all_reduce(t)
assert t[0].item() == n * (n + 1) / 2
if r == n - 1:
    sys.exit(0)                       # the excluded rank leaves
assert dist.get_backend() == "spmd"
pg = dist.group.WORLD
assert pg._get_backend(torch.device("cpu")).supports_shrinking
new = dist.shrink_group([n - 1])
m = dist.get_world_size()
t = torch.full((3,), dist.get_rank() + 1.0); dist.all_reduce(t)
try:
    dist.all_reduce(torch.ones(1), group=sub)
    old = "works"
except Exception as exc:
    old = type(exc).__name__
line = f"RESULT {r} {dist.get_rank()} {m} {new is dist.group.WORLD} {t.tolist()} {old}\n"
os.write(1, line.encode())   # one write: the ranks' lines never interleave
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [3, 4])
def test_torch_shrink_group_runs_on_the_spmd_backend(n):
    pytest.importorskip("torch.distributed")
    proc = run(mpiexec(n, sys.executable, "-c", TORCH_SHRINK), timeout=150)
    out = proc.stdout
    assert proc.returncode == 0, out
    lines = sorted(line for line in out.splitlines() if line.startswith("RESULT "))
    m = n - 1
    total = float(m * (m + 1) / 2)
    assert lines == [f"RESULT {r} {r} {m} True {[total] * 3} ValueError" for r in range(m)], out
