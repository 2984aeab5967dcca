"""Training on the spmd torch backend: FSDP1, FSDP2, DTensor redistribution and a 2-D
DeviceMesh, each an ordinary torch script under ``mpiexec`` (no environment
variables), checked on every rank against a single-process or numpy reference.
Every job runs under a wall-clock limit."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _launch import ROOT, clean_env, mpiexec

pytest.importorskip("torch", reason="torch is not installed")
DIR = "tests/torch_backend"
LIMIT = 240  # seconds for one job (each takes 10-30 s on a loaded 2-core machine)


def _job(n: int, script: str) -> str:
    env = clean_env()
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    proc = subprocess.run(mpiexec(n, sys.executable, f"{DIR}/{script}"), cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=LIMIT, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def _every_rank(out: str, n: int, what: str) -> None:
    for r in range(n):
        assert f"rank {r} of {n}: {what}" in out, out[-4000:]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_fsdp1_matches_single_process(n):
    """Every sharding strategy, use_orig_params both ways, mixed precision, full and
    sharded state_dict (FSDP1 resizes parameter storage to 0: the backend must leave
    every tensor resizable)."""
    _every_rank(_job(n, "fsdp1_script.py"), n, "FSDP1 matches single-process training")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_fsdp2_matches_single_process(n):
    _every_rank(_job(n, "fsdp2_script.py"), n, "FSDP2 matches single-process training")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_dtensor_redistribute(n):
    _every_rank(_job(n, "dtensor_script.py"), n, "DTensor redistribute matches numpy")


def test_device_mesh_2x2():
    _every_rank(_job(4, "mesh_script.py"), 4, "DeviceMesh (2, 2) groups and all_reduce match")
