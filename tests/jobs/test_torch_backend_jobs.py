"""The spmd torch backend from the outside: autoload without MPI, an unmodified DDP
script under srun with no environment variables (under mpiexec:
test_torch_training_jobs.py), and a rank that skips a collective.  Every job runs under
a wall-clock limit."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from _launch import (
    ROOT,
    clean_env,
    mpiexec,
    run,
    slurm_unavailable,
    srun_cannot_start_ranks,
    srun_mpi,
)

pytest.importorskip("torch", reason="torch is not installed")
DIR = "tests/torch_backend"


def _plain(*args, **env):
    return subprocess.run([sys.executable, f"{DIR}/check_autoload.py", *args], cwd=ROOT,
                          env=clean_env(**env), capture_output=True, text=True, timeout=120, check=False)


def test_import_torch_registers_without_starting_mpi():
    proc = _plain()
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[0]) == \
        {"registered": True, "mpi4py.MPI": False, "spmd.runtime": False, "env:// is torch's": True}


def test_env_rendezvous_changes_only_once_the_backend_is_named():
    """torch's env:// stays torch's in a process that names only other backends; naming
    "spmd" (as init_process_group("spmd") does before its rendezvous) adds spmd's
    MPI rendezvous in front, still without starting MPI."""
    proc = _plain("name")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines[0]["env:// is torch's"] is True
    assert lines[1] == {"after gloo": True, "after spmd": False, "name": "spmd",
                        "mpi4py.MPI": False}


def test_autoload_off_then_explicit_import():
    proc = _plain("explicit", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines[0]["registered"] is False and lines[0]["mpi4py.MPI"] is False
    assert lines[1] == {"registered": True}


@pytest.mark.slurm
@pytest.mark.parametrize("nodes, n", [(1, 2), (2, 4)])
def test_unmodified_ddp_script_under_srun(nodes, n):
    if reason := slurm_unavailable() or srun_cannot_start_ranks():
        pytest.skip(reason)
    env = clean_env()  # no SLURM_*/PMI_* of an enclosing job: srun makes its own allocation
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    # --time: SLURM itself ends a job that outlives the limit, even if srun is killed.
    cmd = ["srun", f"--nodes={nodes}", f"--ntasks={n}", f"--mpi={srun_mpi()}", "--time=4",
           sys.executable, f"{DIR}/ddp_script.py"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:]
    for r in range(n):
        assert f"rank {r} of {n}: DDP matches single-process training" in proc.stdout, \
            proc.stdout[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_skipped_all_reduce_names_the_rank(n):
    proc = run(mpiexec(n, sys.executable, f"{DIR}/skip_all_reduce.py", "3"), timeout=120)
    out = proc.stdout
    assert proc.returncode != 0
    assert "DistTimeoutError: all_reduce: did not complete within" in out, out[-4000:]
    straggler = n - 1
    m = re.search(r"ranks that have not reached all_reduce #\d+:\s*\n.*rank (\d+):", out)
    assert m and int(m.group(1)) == straggler, out[-4000:]
    assert "time.sleep(600)" in out  # where the straggler is


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_timed_out_ddp_all_reduce_raises_in_backward():
    """DDP's reducer waits on the Work's future in C++: past its timeout the future fails
    (it used to never complete, and a failed one crashed the reducer)."""
    pytest.importorskip("torch.distributed")
    proc = run(mpiexec(2, sys.executable, "tests/programs/ddp_timeout.py"), timeout=90)
    out = proc.stdout
    assert "RESULT raised RuntimeError: " in out, out
    assert "DistTimeoutError: all_reduce: did not complete within 3.0 s" in out, out
