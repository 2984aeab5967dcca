"""The MPI library's own launcher, which starts the ranks of :func:`spmd.spawn`.

:func:`find_launcher` finds the ``mpiexec`` of the MPI library the ranks will load:
``$SPMD_MPIEXEC`` when set, else the first MPI launcher next to ``sys.executable``, in
``sys.prefix/bin`` (where the MPI wheels put theirs, so a virtual environment's ``bin``
need not be on ``PATH``) or on ``PATH``.  ``mpiexec --version`` says which one it is:
Hydra (MPICH, and Intel MPI's) or Open MPI's, which needs ``--oversubscribe`` to run
more ranks than cores, as a notebook's test job often does, and ``--allow-run-as-root``
in containers.  :func:`launcher_environment` is the environment it runs in.
"""

from __future__ import annotations

import functools
import os
import shutil
import site
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spmd.core.launch import HYDRA, OPENMPI, SINGLETON, launch_info

__all__ = ["Launcher", "find_launcher", "launcher_environment"]

MPIEXEC_VAR = "SPMD_MPIEXEC"

# Variables by which a launcher tells its processes which job they are (PMI, PMIx, Open
# MPI's, Hydra's), and SLURM's, by which Hydra and Open MPI's launcher would place ranks
# on other nodes of an allocation, out of reach of the caller's loopback socket.
_JOB_VARIABLES: tuple[str, ...] = ("PMI_", "PMIX_", "PRTE_", "OMPI_", "HYDRA_", "MPI_LOCALRANKID",
                  "MPI_LOCALNRANKS")
_ALLOCATION_VARIABLES: tuple[str, ...] = ("SLURM_",)

# Where spmd itself is: the ranks must import the spmd the caller runs.
_SPMD_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Launcher:
    """An ``mpiexec`` and what kind it is (``core.launch.HYDRA``, ``OPENMPI``, or
    ``"unknown"`` for one ``$SPMD_MPIEXEC`` names that says neither)."""

    path: str
    kind: str

    def command(self, nprocs: int, program: Sequence[str]) -> list[str]:
        """The command line that runs ``program`` as ``nprocs`` ranks."""
        flags = []
        if self.kind == OPENMPI:
            flags.append("--oversubscribe")
            if os.geteuid() == 0:  # Open MPI refuses root without it
                flags.append("--allow-run-as-root")
        return [self.path, *flags, "-n", str(nprocs), *program]


@functools.cache
def _kind(path: str) -> str | None:
    """What ``path --version`` says the launcher is, or None for something else."""
    try:
        out = subprocess.run([path, "--version"], check=False, capture_output=True, text=True,
                             timeout=30, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    if "Open MPI" in out or "OpenRTE" in out:   # Open MPI 5 says the first, 4 the second
        return OPENMPI
    if "HYDRA" in out.upper() or "Intel(R) MPI" in out:
        return HYDRA
    return None


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_launcher() -> Launcher:
    """The ``mpiexec`` that starts spawned ranks (see the module's docstring).

    Raises:
        RuntimeError: ``$SPMD_MPIEXEC`` names no executable, or no MPI launcher was found;
            the message says what to install or set.
    """
    chosen = os.environ.get(MPIEXEC_VAR)
    if chosen:
        if not _executable(chosen):
            raise RuntimeError(f"spawn: {MPIEXEC_VAR}={chosen} is not an executable file")
        return Launcher(chosen, _kind(os.path.realpath(chosen)) or "unknown")
    candidates = [os.path.join(os.path.dirname(sys.executable), "mpiexec"),
                  os.path.join(sys.prefix, "bin", "mpiexec")]
    on_path = shutil.which("mpiexec")
    if on_path:
        candidates.append(on_path)
    others = []
    for path in dict.fromkeys(candidates):
        if not _executable(path):
            continue
        kind = _kind(os.path.realpath(path))
        if kind is not None:
            return Launcher(path, kind)
        others.append(path)
    not_mpi = f"; not an MPI launcher: {', '.join(others)}" if others else ""
    raise RuntimeError(
        f"spawn: no MPI launcher found (looked for mpiexec next to {sys.executable}, in "
        f"{sys.prefix}/bin and on PATH{not_mpi}); install an MPI wheel into this environment "
        f"(pip install 'spmd[mpich]') or set {MPIEXEC_VAR} to the mpiexec of the MPI library "
        "mpi4py uses")


def launcher_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """The environment the launcher and its ranks start with: the caller's, less the
    variables of the job the caller may itself be a rank of and of a SLURM allocation (the
    ranks are a job of their own, on this host), with spmd importable, plus ``extra``."""
    drop = _ALLOCATION_VARIABLES
    if launch_info().launcher != SINGLETON:
        drop = _ALLOCATION_VARIABLES + _JOB_VARIABLES
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    if _SPMD_ROOT not in _site_directories():
        # spmd runs from a source tree (an editable install, a path the caller added):
        # python -m spmd.spawn.child finds it there, and not some other installed spmd.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_SPMD_ROOT, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


@functools.cache
def _site_directories() -> frozenset[str]:
    dirs = set(site.getsitepackages())
    dirs.add(site.getusersitepackages())
    return frozenset(os.path.abspath(d) for d in dirs)
