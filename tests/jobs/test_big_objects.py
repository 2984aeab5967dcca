"""Objects larger than 2 GiB (a separate 2-rank job: it needs about 9 GB of memory)."""

import sys

import pytest
from _launch import mpiexec, run

pytestmark = pytest.mark.slow   # tests/run.sh rest, not README's quick command


@pytest.mark.timeout(300)
def test_objects_over_2_gib():
    proc = run(mpiexec(2, sys.executable, "tests/programs/big_objects.py"), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "rank 0 big objects OK" in proc.stdout and "rank 1 big objects OK" in proc.stdout
