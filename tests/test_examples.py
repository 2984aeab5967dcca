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


def run_example(name, n, *args, timeout=60):
    """Run examples/<name>.py on n ranks; each rank must print its own OK line."""
    proc = run(mpiexec(n, sys.executable, f"examples/{name}.py", *args), timeout=timeout)
    assert proc.returncode == 0, proc.stdout
    lines = sorted(re.findall(rf"rank (\d+)/(\d+) {name} OK", proc.stdout))
    assert lines == sorted((str(r), str(n)) for r in range(n)), proc.stdout
    return proc.stdout


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["dp_mlp", "tp_mlp", "pp_1f1b"])
def test_parallel_example(name, n):
    run_example(name, n)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("bucket_bytes, buckets", [(1, 6), (1 << 20, 1)])
def test_dp_mlp_bucket_sizes(bucket_bytes, buckets):
    # One bucket per parameter, and one bucket for the whole model.
    out = run_example("dp_mlp", 3, "--bucket-bytes", str(bucket_bytes))
    assert out.count(f"buckets={buckets} ") == 3, out


@pytest.mark.timeout(120)
def test_three_d():
    run_example("three_d", 8, timeout=90)
