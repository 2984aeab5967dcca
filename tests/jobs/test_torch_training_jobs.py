"""Training on the spmd torch backend: DDP, FSDP1, FSDP2, DTensor redistribution and a
2-D DeviceMesh, each an ordinary torch script under ``mpiexec`` (no environment
variables), checked on every rank against a single-process or numpy reference.
Every job runs under a wall-clock limit."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _launch import ROOT, clean_env, mpiexec

pytest.importorskip("torch", reason="torch is not installed")

pytestmark = pytest.mark.slow   # tests/run.sh rest, not README's quick command
DIR = "tests/torch_backend"
LIMIT = 240  # seconds for one job (20-60 s on a loaded 2-core machine)


def _job(n: int, script: str, *args: str) -> str:
    env = clean_env()
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    proc = subprocess.run(mpiexec(n, sys.executable, f"{DIR}/{script}", *args), cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=LIMIT, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def _every_rank(out: str, n: int, what: str) -> None:
    for r in range(n):
        assert f"rank {r} of {n}: {what}" in out, out[-4000:]


# script -> what each rank prints when its training matched the reference.  One job per
# world size runs them all in turn (tests/torch_backend/run_scripts.py): each rank pays
# for importing torch and starting MPI once, not once per script.
TRAINING = {
    "ddp_script.py": "DDP matches single-process training",
    "fsdp1_script.py": "FSDP1 matches single-process training",
    "fsdp2_script.py": "FSDP2 matches single-process training",
    "dtensor_script.py": "DTensor redistribute matches numpy",
}
MESH = {"mesh_script.py": "DeviceMesh (2, 2) groups and all_reduce match"}   # 4 ranks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ddp_fsdp1_fsdp2_and_dtensor_match_their_references(n):
    """Unmodified scripts, launched with no environment variables, each checked on every
    rank: DDP and FSDP2 against one process training on the whole batch; FSDP1 with
    every sharding strategy, use_orig_params both ways, mixed precision, full and
    sharded state_dict (FSDP1 resizes parameter storage to 0: the backend must leave
    every tensor resizable); DTensor redistribution against numpy; at 4 ranks also a
    2-D DeviceMesh's groups."""
    scripts = {**TRAINING, **(MESH if n == 4 else {})}
    out = _job(n, "run_scripts.py", *scripts)
    for what in scripts.values():
        _every_rank(out, n, what)
