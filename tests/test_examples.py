"""The examples run under mpiexec at several sizes and check themselves against serial
computations; this test runs them (plain pytest, each job under a time limit)."""

import re
import sys

import pytest

from _launch import mpiexec, run


@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_quickstart(n):
    proc = run(mpiexec(n, sys.executable, "examples/quickstart.py"), timeout=120)
    assert proc.returncode == 0, proc.stdout
    lines = sorted(re.findall(r"rank (\d+)/(\d+) quickstart OK", proc.stdout))
    assert lines == sorted((str(r), str(n)) for r in range(n)), proc.stdout
