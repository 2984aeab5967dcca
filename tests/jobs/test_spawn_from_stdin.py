"""spmd.spawn from a script read from stdin (``python - < train.py``): there is no file
the ranks could run to find the script's functions, so without cloudpickle spawn says
what to do before it starts anything; with cloudpickle the functions travel by value."""

import importlib.util
import subprocess
import sys

import pytest
from _launch import ROOT, clean_env

SCRIPT = """
import numpy as np
import spmd

def train(rank, lr):
    x = np.full(4, rank, np.float32)
    spmd.all_reduce(x)
    return float(x[0]) * lr

if __name__ == "__main__":
    print("results", spmd.spawn(train, args=(0.5,), nprocs=2))
"""


def _from_stdin(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-"], input=SCRIPT, cwd=ROOT, env=clean_env(**env),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)


@pytest.mark.timeout(150)
def test_without_cloudpickle_it_says_what_to_do(tmp_path):
    (tmp_path / "cloudpickle.py").write_text("raise ImportError('not installed here')\n")
    proc = _from_stdin(PYTHONPATH=f"{tmp_path}:{ROOT}")
    assert proc.returncode != 0, proc.stdout
    assert "TypeError: spawn: fn='train' is defined in a __main__ that has no file" in \
        proc.stdout, proc.stdout
    assert "`python - < script.py`" in proc.stdout and "(`python script.py`)" in proc.stdout
    assert "pip install cloudpickle" in proc.stdout
    assert "FileNotFoundError" not in proc.stdout, proc.stdout   # no rank was started


@pytest.mark.timeout(150)
def test_with_cloudpickle_it_runs():
    if importlib.util.find_spec("cloudpickle") is None:
        pytest.skip("cloudpickle is not installed")
    proc = _from_stdin()
    assert proc.returncode == 0, proc.stdout
    assert "results [0.5, 0.5]" in proc.stdout, proc.stdout
