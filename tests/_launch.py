"""Starting MPI jobs from plain pytest tests, always under a wall-clock limit."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def next_to_python(name: str) -> str | None:
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


@functools.cache
def mpiexec_prefix() -> tuple[str, ...]:
    """mpiexec from $SPMD_MPIEXEC, next to sys.executable, or PATH, with the flags Open MPI
    needs to run more ranks than cores (and as root in containers)."""
    exe = os.environ.get("SPMD_MPIEXEC") or next_to_python("mpiexec") or shutil.which("mpiexec")
    if exe is None:
        raise RuntimeError("no mpiexec found: set SPMD_MPIEXEC or install the 'mpich' extra")
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    if "Open MPI" in version or "OpenRTE" in version:
        return (exe, "--oversubscribe", "--allow-run-as-root")
    return (exe,)


def mpiexec(n: int, *args: str) -> list[str]:
    return [*mpiexec_prefix(), "-n", str(n), *args]


def clean_env(**extra: str) -> dict:
    """The environment for a child job: spmd importable, and no variables of the launcher
    this test may itself run under (a child must not think it is part of that job)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    for var in list(env):
        if var.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_LOCALRANKID", "SLURM_")):
            del env[var]
    env.update(extra)
    return env


def run(cmd: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repository root; a job past ``timeout`` is killed and fails."""
    return subprocess.run(cmd, cwd=ROOT, env=clean_env(**env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def slurm_unavailable() -> str | None:
    """Why srun cannot start a job here, or None when a SLURM node is up."""
    hint = "(start a local cluster with: sudo bash slurm/setup_local_cluster.sh)"
    missing = [c for c in ("srun", "sinfo") if shutil.which(c) is None]
    if missing:
        return f"SLURM not available: {', '.join(missing)} not on PATH {hint}"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                              timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return f"SLURM cluster not up: sinfo timed out {hint}"
    states = proc.stdout.split()
    if proc.returncode != 0 or not {"idle", "mix", "alloc"} & set(states):
        return f"SLURM cluster not up: sinfo: {(proc.stderr or proc.stdout).strip()!r} {hint}"
    return None


# srun's PMI plugin for each MPI library's ranks (pmi2, which MPICH and Intel MPI speak,
# for the others): the plugin spmd.spawn picks too.
SRUN_MPI = {"Open MPI": "pmix"}


@functools.cache
def mpi_vendor() -> str:
    """The MPI library mpi4py loads in this environment ("MPICH", "Open MPI", "Intel MPI"),
    asked in a process of its own (the test process stays without MPI)."""
    return subprocess.run([sys.executable, "-c", "from mpi4py import MPI; print(MPI.get_vendor()[0])"],
                          capture_output=True, text=True, timeout=60, check=True,
                          env=clean_env()).stdout.strip()


def srun_mpi() -> str:
    """The ``--mpi`` plugin srun needs for this environment's MPI library."""
    return SRUN_MPI.get(mpi_vendor(), "pmi2")


@functools.cache
def srun_cannot_start_ranks() -> str | None:
    """Why srun cannot start this MPI library's ranks on this cluster, or None: its PMI
    plugin is tried once (pmi2 is what a SLURM build always has)."""
    plugin = srun_mpi()
    if plugin == "pmi2":
        return None
    probe = subprocess.run(["srun", f"--mpi={plugin}", "--ntasks=1", "--time=1", "true"],
                           capture_output=True, text=True, timeout=120, check=False,
                           env=clean_env())
    if probe.returncode == 0:
        return None
    said = (probe.stderr.strip().splitlines() or ["no message"])[-1]
    return (f"{mpi_vendor()}'s ranks need srun --mpi={plugin}, which this SLURM cannot run "
            f"({said})")
