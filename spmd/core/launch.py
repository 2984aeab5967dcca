"""What started this process: the launcher, job id and nodes, read from the environment.

Recognised: ``mpiexec``/``mpirun`` of MPICH (Hydra) and Open MPI, ``srun`` (SLURM) and a
plain ``python`` (a singleton: a world of one).  :func:`check_world_size` warns when
MPI made a singleton where the launcher started several processes, the usual sign of
an mpi4py built against another MPI than the launcher's, or of ``srun`` without the
PMI plugin the MPI library speaks.
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["LOCAL_RANK_VARS", "LaunchInfo", "check_world_size", "launch_info",
           "local_rank_from_env"]

# Launcher names in LaunchInfo.launcher
SLURM, OPENMPI, HYDRA, SINGLETON = "slurm", "openmpi", "hydra", "singleton"


@dataclass(frozen=True)
class LaunchInfo:
    """The launcher spmd found and what it says about the job, for logs.

    Attributes:
        launcher: ``"slurm"`` (srun), ``"openmpi"`` (Open MPI's mpirun/mpiexec),
            ``"hydra"`` (MPICH's mpiexec, or another PMI launcher) or ``"singleton"``.
        job_id: the job id (SLURM_JOB_ID, Open MPI's job id or PMIx namespace), if any.
        nodes: the job's node list as SLURM writes it (``vm-[1-2]``), if known.
        ntasks: how many processes the launcher says it started.
        rank: this process's rank, as the launcher says (before MPI is asked).
        local_rank: this process's rank on its node, as the launcher says.
        hostname: this host.
    """

    launcher: str
    job_id: str | None = None
    nodes: str | None = None
    ntasks: int | None = None
    rank: int | None = None
    local_rank: int | None = None
    hostname: str = field(default_factory=socket.gethostname)

    def describe(self) -> str:
        """One line for logs: ``launcher=slurm job=123 nodes=vm-[1-2] ntasks=4 host=vm-1``."""
        parts = [f"launcher={self.launcher}"]
        for key, value in (("job", self.job_id), ("nodes", self.nodes), ("ntasks", self.ntasks),
                           ("rank", self.rank), ("local_rank", self.local_rank)):
            if value is not None:
                parts.append(f"{key}={value}")
        parts.append(f"host={self.hostname}")
        return " ".join(parts)


def _int(value: str | None) -> int | None:
    value = (value or "").strip()
    return int(value) if value.isdigit() else None


def _slurm_nodes(env) -> str | None:
    return env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")


# Where launchers put a process's rank on its node: torchrun, MPICH's Hydra, Open MPI,
# PMI, SLURM.
LOCAL_RANK_VARS = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK",
                   "PMI_LOCAL_RANK", "SLURM_LOCALID")


def local_rank_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's rank on its node as the launcher set it (LOCAL_RANK_VARS, first
    found), or None."""
    env = os.environ if environ is None else environ
    for var in LOCAL_RANK_VARS:
        value = env.get(var)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


def launch_info(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read the launcher's variables (OMPI_*, PMI_*/HYDRA_*/MPI_LOCALRANKID, SLURM_*).

    An mpiexec inside a SLURM allocation is reported as that mpiexec, with the
    allocation's job id and nodes.
    """
    env = os.environ if environ is None else environ
    slurm_job, slurm_nodes = env.get("SLURM_JOB_ID"), _slurm_nodes(env)
    if "OMPI_COMM_WORLD_SIZE" in env:
        return LaunchInfo(OPENMPI,
                          slurm_job or env.get("OMPI_MCA_ess_base_jobid")
                          or env.get("PMIX_NAMESPACE"),
                          slurm_nodes, _int(env.get("OMPI_COMM_WORLD_SIZE")),
                          _int(env.get("OMPI_COMM_WORLD_RANK")),
                          _int(env.get("OMPI_COMM_WORLD_LOCAL_RANK")))
    if "MPI_LOCALRANKID" in env or "PMI_HOSTNAME" in env or "HYDRA_CONTROL_FD" in env:
        return LaunchInfo(HYDRA, slurm_job or env.get("PMI_JOBID"), slurm_nodes,
                          _int(env.get("PMI_SIZE")), _int(env.get("PMI_RANK")),
                          _int(env.get("MPI_LOCALRANKID")))
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        ntasks = _int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS"))
        return LaunchInfo(SLURM, slurm_job, slurm_nodes, ntasks, _int(env.get("SLURM_PROCID")),
                          _int(env.get("SLURM_LOCALID")))
    if "PMI_RANK" in env or "PMI_FD" in env or "PMIX_RANK" in env:
        rank = _int(env.get("PMI_RANK"))
        return LaunchInfo(HYDRA, slurm_job or env.get("PMI_JOBID") or env.get("PMIX_NAMESPACE"),
                          slurm_nodes, _int(env.get("PMI_SIZE")),
                          _int(env.get("PMIX_RANK")) if rank is None else rank)
    return LaunchInfo(SINGLETON, slurm_job, slurm_nodes, 1, 0, 0)


def singleton_problem(world_size: int, environ=None, *, library: str) -> str | None:
    """Why a world of ``world_size`` looks wrong for this environment, or None.

    Only a singleton (``world_size == 1``) started where the launcher says it started
    several processes is flagged.  ``library`` names the MPI library this process loaded
    (the first line of ``MPI_Get_library_version``), for the message: the caller, which
    has MPI, asks it.
    """
    if world_size != 1:
        return None
    env = os.environ if environ is None else environ
    info = launch_info(env)
    if info.launcher == SLURM and (info.ntasks or 1) > 1:
        return (f"srun started {info.ntasks} tasks (SLURM_STEP_NUM_TASKS/SLURM_NTASKS) but MPI "
                f"made this process a world of 1: srun probably used a PMI plugin this MPI "
                f"({library}) does not speak; run `srun --mpi=pmi2 ...` (MPICH) or "
                f"`srun --mpi=pmix ...` (Open MPI), see `srun --mpi=list`")
    if info.launcher == SINGLETON and (_int(env.get("SLURM_NTASKS")) or 1) > 1:
        return (f"this allocation has SLURM_NTASKS={env.get('SLURM_NTASKS')} but python was "
                "started without srun, so it runs alone; start the ranks with "
                "`srun --mpi=pmi2 python ...`")
    if info.launcher == HYDRA and (info.ntasks or 1) > 1:
        return (f"an mpiexec using PMI started {info.ntasks} processes (PMI_SIZE) but MPI made "
                f"this process a world of 1: mpi4py's MPI ({library}) is probably not the MPI of "
                "that mpiexec; use the mpiexec of the same installation (for the mpich wheel: "
                "the one next to python in the virtual environment)")
    if info.launcher == OPENMPI and (info.ntasks or 1) > 1:
        return (f"Open MPI's mpirun started {info.ntasks} processes (OMPI_COMM_WORLD_SIZE) but "
                f"MPI made this process a world of 1: mpi4py's MPI ({library}) is probably not "
                "Open MPI; use the mpiexec of the MPI mpi4py was built with")
    return None


def check_world_size(world_size: int, environ=None, *, library: str) -> None:
    """Warn (RuntimeWarning) when ``singleton_problem`` finds one."""
    problem = singleton_problem(world_size, environ, library=library)
    if problem:
        warnings.warn(f"spmd: {problem}", RuntimeWarning, stacklevel=3)


def loaded_libmpi() -> str | None:
    """The path of the libmpi this process has loaded (mpi4py's), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "/libmpi" in path and ".so" in path:
                    return path
    except OSError:
        pass
    return None
