"""The launch environment: which launcher started us, and the warning for a singleton
started where the launcher meant several processes.  The environments below are the
variables each launcher really sets (Hydra of the mpich wheel, Open MPI 5's prterun,
and Slurm 22.05: a batch script, srun without and with --mpi=pmi2)."""

import re
import sys
import warnings

import pytest
from _launch import mpiexec, mpiexec_prefix, run

from spmd.core import launch

HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "4", "PMI_FD": "9", "PMI_HOSTNAME": "vm",
         "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
OPENMPI = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "PMIX_NAMESPACE": "prterun-vm-1234@1",
           "PMIX_RANK": "2"}
BATCH = {"SLURM_JOB_ID": "26", "SLURM_JOB_NODELIST": "vm-[1-2]", "SLURM_LOCALID": "0",
         "SLURM_NODEID": "0", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}
SRUN = {**BATCH, "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "vm-2"}
SRUN_PMI2 = {**SRUN, "PMI_FD": "11", "PMI_JOBID": "26.1", "PMI_RANK": "3", "PMI_SIZE": "4"}
LIBRARY = "MPICH Version:      4.3.0"   # what the caller passes: its MPI's first line


@pytest.mark.parametrize("env, expected", [
    ({}, ("singleton", None, None, 1, 0, 0)),
    (HYDRA, ("hydra", None, None, 4, 1, 1)),
    ({**HYDRA, "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-4]"},
     ("hydra", "7", "n[1-4]", 4, 1, 1)),  # mpiexec inside an allocation
    (OPENMPI, ("openmpi", "prterun-vm-1234@1", None, 4, 2, 0)),
    (SRUN, ("slurm", "26", "vm-[1-2]", 4, 3, 1)),
    (SRUN_PMI2, ("slurm", "26", "vm-[1-2]", 4, 3, 1)),
    (BATCH, ("singleton", "26", "vm-[1-2]", 1, 0, 0)),  # python run straight from sbatch
], ids=["plain", "hydra", "hydra-in-slurm", "openmpi", "srun", "srun-pmi2", "batch"])
def test_launch_info(env, expected):
    info = launch.launch_info(env)
    assert (info.launcher, info.job_id, info.nodes, info.ntasks, info.rank,
            info.local_rank) == expected


def test_describe_for_logs():
    info = launch.launch_info(SRUN_PMI2)
    line = info.describe()
    assert line.startswith("launcher=slurm job=26 nodes=vm-[1-2] ntasks=4 rank=3 local_rank=1 ")
    assert line.endswith(f"host={info.hostname}")
    assert launch.launch_info({}).describe().startswith("launcher=singleton ntasks=1")


@pytest.mark.parametrize("env, needle", [
    (SRUN, ("srun started 4 tasks (SLURM_STEP_NUM_TASKS/SLURM_NTASKS) but MPI made this "
            "process a world of 1")),
    (SRUN, "run `srun --mpi=pmi2 ...`"),
    (BATCH, "SLURM_NTASKS=4 but python was started without srun"),
    (HYDRA, ("started 4 processes (PMI_SIZE) but MPI made this process a world of 1: "
             f"mpi4py's MPI ({LIBRARY}) is probably not the MPI of that mpiexec")),
    (OPENMPI, "Open MPI's mpirun started 4 processes (OMPI_COMM_WORLD_SIZE)"),
], ids=["srun", "srun-hint", "batch", "hydra", "openmpi"])
def test_singleton_problem_says_what_went_wrong(env, needle):
    assert needle in launch.singleton_problem(1, env, library=LIBRARY)


@pytest.mark.parametrize("env", [{}, {**BATCH, "SLURM_NTASKS": "1"},
                                 {**HYDRA, "PMI_SIZE": "1"}])
def test_no_problem_for_a_real_singleton(env):
    assert launch.singleton_problem(1, env, library=LIBRARY) is None


@pytest.mark.parametrize("env", [SRUN, HYDRA, OPENMPI, BATCH])
def test_no_problem_for_a_real_world(env):
    assert launch.singleton_problem(4, env, library=LIBRARY) is None


def test_check_world_size_warns():
    with pytest.warns(RuntimeWarning, match="spmd: srun started 4 tasks"):
        launch.check_world_size(1, SRUN, library=LIBRARY)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch.check_world_size(4, SRUN, library=LIBRARY)
        launch.check_world_size(1, {}, library=LIBRARY)


# One write per line: mpiexec merges the ranks' output line by line.
_SHOW = "import sys, spmd; sys.stdout.write(spmd.launch_info().describe() + '\\n')"


@pytest.mark.timeout(120)
def test_under_mpiexec():
    proc = run(mpiexec(2, sys.executable, "-c", _SHOW), timeout=90)
    assert proc.returncode == 0, proc.stdout
    lines = sorted(ln for ln in proc.stdout.splitlines() if ln.startswith("launcher="))
    # Open MPI's mpiexec (it takes --oversubscribe) sets OMPI_*, Hydra (MPICH, Intel MPI) PMI_*
    name = "openmpi" if "--oversubscribe" in mpiexec_prefix() else "hydra"
    # Open MPI also names its job (job=prterun-...@1); Hydra outside SLURM has none
    assert [re.sub(r" job=\S+", "", ln.split(" host=")[0]) for ln in lines] == [
        f"launcher={name} ntasks=2 rank=0 local_rank=0",
        f"launcher={name} ntasks=2 rank=1 local_rank=1"]


@pytest.mark.timeout(120)
def test_misplaced_singleton_warns_at_init():
    code = "import spmd; spmd.init_process_group(); print('size', spmd.get_world_size())"
    env = {k: v for k, v in SRUN.items()}
    proc = run([sys.executable, "-c", code], timeout=90, **env)
    assert proc.returncode == 0, proc.stdout
    assert "size 1" in proc.stdout
    assert "RuntimeWarning: spmd: srun started 4 tasks" in proc.stdout
    assert "--mpi=pmi2" in proc.stdout
    quiet = run([sys.executable, "-c", code], timeout=90)
    assert "RuntimeWarning" not in quiet.stdout and "size 1" in quiet.stdout


def test_other_pmi_launchers():
    info = launch.launch_info({"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_FD": "5"})
    assert (info.launcher, info.rank, info.ntasks) == ("hydra", 0, 2)
    info = launch.launch_info({"PMIX_RANK": "3", "PMIX_NAMESPACE": "ns"})
    assert (info.launcher, info.rank, info.job_id) == ("hydra", 3, "ns")


@pytest.mark.parametrize("env, expected", [
    ({"LOCAL_RANK": "3", "SLURM_LOCALID": "1"}, 3),   # torchrun's wins
    ({"MPI_LOCALRANKID": "2"}, 2),                     # MPICH's Hydra
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}, 1),          # Open MPI
    ({"PMI_LOCAL_RANK": "0"}, 0),
    ({"SLURM_LOCALID": "5"}, 5),                       # srun
    ({"LOCAL_RANK": "x", "SLURM_LOCALID": "4"}, 4),    # not a number: the next one
    ({}, None),
])
def test_local_rank_from_the_launchers_variables(env, expected):
    assert launch.local_rank_from_env(env) == expected
