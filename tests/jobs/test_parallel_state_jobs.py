"""parallel_state at 8, 12 and 16 ranks: a separate job checks every group of every
layout helper (tests/programs/layouts.py; the in-job tests: tests/mpi/test_parallel_state.py)."""

import re
import sys

import pytest
from _launch import mpiexec, run

pytestmark = pytest.mark.slow   # tests/run.sh rest, not README's quick command

# kind -> (world size getter, rank getter, kwargs), where parallel_state has them


def _layouts(n, k, *args):
    proc = run(mpiexec(n, sys.executable, "tests/programs/layouts.py", *args), timeout=540,
               SPMD_PSEUDO_NODE_SIZE=str(k))
    assert proc.returncode == 0, proc.stdout[-5000:]
    lines = re.findall(rf"^rank (\d+)/{n} layouts OK: (\d+) mesh, (\d+) parallel_state "
                       r"\((\d+) configurations\), (\d+) topology", proc.stdout, re.MULTILINE)
    assert sorted(int(r[0]) for r in lines) == list(range(n)), proc.stdout[-5000:]
    mesh, pstate, configs, topo = map(int, lines[0][1:])
    # 14 group kinds and the two embedding kinds per configuration
    assert configs > 0 and pstate == 16 * configs
    assert (mesh > 0 and topo > 0) or "--ps-only" in args


@pytest.mark.timeout(600)
def test_every_group_at_8_ranks():
    _layouts(8, 3, "--all")  # every accepted configuration; pseudo-nodes [0-2] [3-5] [6-7]


@pytest.mark.timeout(600)
def test_every_group_at_12_ranks():
    _layouts(12, 5)  # a selection of configurations; pseudo-nodes [0-4] [5-9] [10-11]


@pytest.mark.timeout(600)
def test_every_parallel_state_group_at_16_ranks():
    _layouts(16, 4, "--ps-only", "3")  # every third configuration of the selection
