"""What started this process: the launcher, job id and nodes, read from the environment."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

__all__ = ["LaunchInfo", "launch_info"]


@dataclass(frozen=True)
class LaunchInfo:
    """The launcher spmd found (``"slurm"``, ``"openmpi"``, ``"hydra"``, ``"singleton"``)
    and what it says about the job, for logs."""

    launcher: str
    job_id: str | None = None
    nodes: str | None = None
    ntasks: int | None = None
    hostname: str = field(default_factory=socket.gethostname)


def _int(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


def launch_info(environ=None) -> LaunchInfo:
    """Read the launcher's variables (SLURM_*, OMPI_*, PMI_*/HYDRA_*)."""
    env = os.environ if environ is None else environ
    if "SLURM_STEP_ID" in env or ("SLURM_JOB_ID" in env and "SLURM_PROCID" in env):
        return LaunchInfo("slurm", env.get("SLURM_JOB_ID"), env.get("SLURM_JOB_NODELIST")
                          or env.get("SLURM_NODELIST"), _int(env.get("SLURM_NTASKS")))
    if "OMPI_COMM_WORLD_SIZE" in env:
        return LaunchInfo("openmpi", env.get("OMPI_MCA_orte_jobid") or env.get("PMIX_NAMESPACE"),
                          None, _int(env.get("OMPI_COMM_WORLD_SIZE")))
    if "PMI_RANK" in env or "HYDRA_CONTROL_FD" in env or "PMI_FD" in env:
        return LaunchInfo("hydra", env.get("PMI_JOBID") or env.get("PMIX_NAMESPACE"), None,
                          _int(env.get("PMI_SIZE")))
    return LaunchInfo("singleton")
