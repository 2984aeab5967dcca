"""The shared-memory engine across pseudo-nodes (jobs of their own: 4 ranks as 2 nodes
of 2, 6 ranks as 3 x 2 and 2 x 3), SPMD_SHM parsing, and what ``spmd info`` reports."""

import os
import sys

import pytest
from _launch import HERE, ROOT, mpiexec, run

from spmd.backends.shm.engine import shm_mode

PROGRAM = "tests/programs/shm_nodes.py"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("ranks,node_size", [(4, 2), (6, 2), (6, 3)])
def test_hierarchical_all_reduce(ranks, node_size):
    proc = run(mpiexec(ranks, sys.executable, PROGRAM), timeout=840,
               SPMD_PSEUDO_NODE_SIZE=str(node_size), PYTHONPATH=os.pathsep.join((ROOT, HERE)))
    assert proc.returncode == 0, proc.stdout[-4000:]
    for r in range(ranks):
        assert f"rank {r} shm nodes OK" in proc.stdout, proc.stdout[-4000:]


def test_shm_mode_values():
    assert shm_mode({}) == "auto"
    assert shm_mode({"SPMD_SHM": "0"}) == "off" == shm_mode({"SPMD_SHM": "off"})
    assert shm_mode({"SPMD_SHM": "Force"}) == "force"
    assert shm_mode({"SPMD_SHM": "1"}) == "auto"
    with pytest.raises(ValueError, match="SPMD_SHM='sometimes'"):
        shm_mode({"SPMD_SHM": "sometimes"})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,expect", [("auto", "auto: 2 rank(s) per node"),
                                         ("0", "off (SPMD_SHM=0)")])
def test_info_reports_the_engine(mode, expect):
    proc = run(mpiexec(2, sys.executable, "-m", "spmd", "info"), timeout=240, SPMD_SHM=mode)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proc.stdout.count(expect) == 2, proc.stdout[-3000:]
