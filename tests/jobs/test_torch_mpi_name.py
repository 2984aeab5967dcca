"""spmd under torch's "mpi" backend name (SPMD_TORCH_MPI=1, spmd.torch._mpi_name): off by
default, on where asked, a script written for torch's MPI backend under mpiexec, and a
torch built with MPI left alone.  Every job runs under a wall-clock limit."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
from _launch import ROOT, clean_env, mpiexec, slurm_unavailable, srun_cannot_start_ranks, srun_mpi

pytest.importorskip("torch", reason="torch is not installed")
DIR = "tests/torch_backend"
NO_MPI = "RuntimeError: Distributed package doesn't have MPI built in."


def _import_torch(*args: str, **env: str) -> list[dict]:
    """What a plain ``import torch`` made of the "mpi" name (check_mpi_name.py), with
    SPMD_TORCH_MPI as given (unset where not)."""
    child = clean_env(**env)
    if "SPMD_TORCH_MPI" not in env:
        child.pop("SPMD_TORCH_MPI", None)
    proc = subprocess.run([sys.executable, f"{DIR}/check_mpi_name.py", *args], cwd=ROOT,
                          env=child, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.mark.parametrize("value", [None, "0"])
def test_off_by_default_torch_is_untouched(value):
    env = {} if value is None else {"SPMD_TORCH_MPI": value}
    said, init = _import_torch("init", **env)
    assert said == {"is_mpi_available": False, "Backend('mpi')": "mpi", "ProcessGroupMPI": None,
                    "warnings": [], "mpi4py.MPI": False, "spmd.runtime": False}
    assert init["raised"].startswith(NO_MPI), init


def test_on_answers_without_starting_mpi():
    [said] = _import_torch(SPMD_TORCH_MPI="1")
    assert said == {"is_mpi_available": True, "Backend('mpi')": "mpi",
                    "ProcessGroupMPI": "spmd.torch._mpi_name.SpmdAsMPI", "warnings": [],
                    "mpi4py.MPI": False, "spmd.runtime": False}


def test_a_wrong_value_warns_once_and_leaves_torch_alone():
    said, init = _import_torch("init", SPMD_TORCH_MPI="maybe")
    assert said["is_mpi_available"] is False and said["ProcessGroupMPI"] is None, said
    assert said["warnings"] == ["spmd: could not answer to torch's \"mpi\" backend name: "
                                "SPMD_TORCH_MPI='maybe' is not a valid setting: expected 1 "
                                "(on) or 0 (off) (spmd answers to torch.distributed's \"mpi\" "
                                "backend name, read at import torch)"], said
    assert init["raised"].startswith(NO_MPI), init


def test_a_torch_built_with_mpi_keeps_its_own(monkeypatch):
    """Where torch has ProcessGroupMPI (built from source with MPI), the variable is
    ignored, with a warning that says so."""
    from torch.distributed import distributed_c10d as c10d

    from spmd.torch import _mpi_name

    class TorchsOwn:  # what a torch built with MPI has
        pass

    monkeypatch.setenv("SPMD_TORCH_MPI", "1")
    monkeypatch.setattr(c10d, "ProcessGroupMPI", TorchsOwn, raising=False)
    monkeypatch.setattr(c10d, "_MPI_AVAILABLE", True)
    monkeypatch.setattr(_mpi_name, "_decided", False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _mpi_name.answer_to_mpi()
    assert c10d.ProcessGroupMPI is TorchsOwn and c10d.is_mpi_available()
    assert [str(w.message) for w in said] == [
        "spmd: SPMD_TORCH_MPI=1 is ignored: this torch was built with MPI, and its own "
        "\"mpi\" backend is kept"]


def _script(cmd: list[str], n: int) -> None:
    env = clean_env(SPMD_TORCH_MPI="1")
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    proc = subprocess.run([*cmd, sys.executable, f"{DIR}/mpi_name_script.py"], cwd=ROOT,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:]
    for r in range(n):
        assert f"rank {r} of {n}: the \"mpi\" backend is spmd's" in proc.stdout, proc.stdout[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_script_for_torchs_mpi_backend_runs_on_spmd(n):
    _script(mpiexec(n), n)


@pytest.mark.slurm
def test_a_script_for_torchs_mpi_backend_runs_on_spmd_under_srun():
    if reason := slurm_unavailable() or srun_cannot_start_ranks():
        pytest.skip(reason)
    # --time: SLURM itself ends a job that outlives the limit, even if srun is killed.
    _script(["srun", "--nodes=1", "--ntasks=2", f"--mpi={srun_mpi()}", "--time=4"], 2)
