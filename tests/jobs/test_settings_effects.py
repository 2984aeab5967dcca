"""Every setting declared in spmd.core.settings takes effect from the environment of a
job, whatever the program imports: each is set in a job's environment and its documented
effect checked.  Most run in two jobs of tests/programs/setting_effects.py (settings that
fit together); the rest have a job of their own elsewhere, named in ELSEWHERE.  A new
setting fails test_every_setting_has_an_effect_test until it is in one or the other."""

from __future__ import annotations

import ast
import os
import re
import sys

import pytest
from _launch import ROOT, mpiexec, run

from spmd.core import settings

PROGRAM = os.path.join("tests", "programs", "setting_effects.py")

# The settings each job of setting_effects.py sets (values away from their defaults, and
# a 0 where 0 means something).  Directories are filled in by the test.
JOBS = {
    "changed": {
        "SPMD_TIMEOUT": "1.5", "SPMD_QUERY_TIMEOUT": "0.7", "SPMD_DEBUG": "DETAIL",
        "SPMD_FLIGHT_RECORDER_SIZE": "24", "SPMD_WATCHDOG_INTERVAL": "0.05",
        "SPMD_HEARTBEAT_TIMEOUT": "0.5", "SPMD_WAIT": "yield", "SPMD_FUSION_BYTES": "1024",
        "SPMD_SHM": "0", "SPMD_FASTCALL": "0", "SPMD_PERSISTENT": "0",
        "SPMD_PSEUDO_NODE_SIZE": "1", "SPMD_CUDA_AWARE_MPI": "1",
        "SPMD_DEVICE_DOUBLE_LAG": "0.3", "SPMD_DEVICE_DOUBLE_DIR": "{tmp}",
    },
    "zeros": {
        "SPMD_WATCHDOG": "0", "SPMD_FLIGHT_RECORDER_SIZE": "0", "SPMD_SHM": "force",
        "SPMD_WAIT": "spin", "SPMD_FASTCALL": "1", "SPMD_CUDA_AWARE_MPI": "0",
        "SPMD_DEVICE_DOUBLE_LAG": "0",
    },
}
# Seen by rank 0 only: it waits for a receive; rank 1 holds it up.
RANK_0_ONLY = {"SPMD_TIMEOUT", "SPMD_QUERY_TIMEOUT"}

# Settings whose effect is a job of its own: the test that sets it and checks it.
ELSEWHERE = {
    "SPMD_ABORT_ON_EXCEPTION": "tests/jobs/test_reliability_jobs.py::"
                               "test_abort_on_exception_can_be_turned_off",
    "SPMD_TRACEBACK": "tests/jobs/test_uncaught_tracebacks.py::"
                      "test_full_traceback_shows_spmd_s_frames",
    "SPMD_DUMP_DIR": "tests/jobs/test_reliability_jobs.py::"
                     "test_flight_recorder_dumps_are_private_and_merge",
    "SPMD_COMMS_LOG": "tests/jobs/test_bench.py::"
                      "test_env_switches_take_effect_though_the_program_imports_the_tools_late",
    "SPMD_TRACE": "tests/jobs/test_bench.py::"
                  "test_env_switches_take_effect_though_the_program_imports_the_tools_late",
    "SPMD_MPIEXEC": "tests/jobs/test_spawn.py::test_bad_input_raises_before_anything_starts",
    "SPMD_SPAWN_HOST": "tests/jobs/test_spawn.py::"
                       "test_inside_a_slurm_allocation_srun_runs_the_ranks_on_its_nodes",
    "SPMD_SPAWN_ADDRESS": "tests/jobs/test_spawn_channel.py::"
                          "test_a_listener_without_the_token_gets_neither_it_nor_an_unpickle",
    "SPMD_SPAWN_TOKEN": "tests/jobs/test_spawn_channel.py::"
                        "test_a_listener_without_the_token_gets_neither_it_nor_an_unpickle",
    "SPMD_JOIN_PORT": "tests/jobs/test_ulfm_jobs.py::test_an_abort_under_ulfm_ends_the_job",
    "SPMD_TORCH_MPI": "tests/jobs/test_torch_mpi_name.py::test_on_answers_without_starting_mpi",
    "SPMD_DEVICE_TIMEOUT": "tests/jobs/test_gpu_timeout_jobs.py::"
                           "test_a_timed_out_nccl_op_raises_on_every_read_through_spmd_when_asked",
}


def test_every_setting_has_an_effect_test():
    in_jobs = set().union(*JOBS.values())
    assert in_jobs | set(ELSEWHERE) == set(settings.SETTINGS), \
        sorted(set(settings.SETTINGS) ^ (in_jobs | set(ELSEWHERE)))
    for name, where in ELSEWHERE.items():
        path, _, test = where.partition("::")
        source = open(os.path.join(ROOT, path)).read()
        tests = {node.name: ast.get_source_segment(source, node)
                 for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
        assert test in tests, f"{name}: {path} has no {test}"
        # The setting is set in that test (or in a program its module runs).
        assert name in tests[test] or _programs_name(source, name), \
            f"{name} is not set in {where}"


def _programs_name(source: str, name: str) -> bool:
    """Whether a program under tests/programs that ``source`` runs names ``name``."""
    for program in set(re.findall(r"[\w/]*?(\w+\.py)", source)):
        path = os.path.join(ROOT, "tests", "programs", program)
        if os.path.exists(path) and name in open(path).read():
            return True
    return False


@pytest.mark.timeout(150)
@pytest.mark.parametrize("job", sorted(JOBS))
def test_settings_take_effect_from_the_environment(job, tmp_path):
    env = {k: v.format(tmp=tmp_path) for k, v in JOBS[job].items()}
    proc = run(mpiexec(2, sys.executable, PROGRAM), timeout=120, **env)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} setting_effects OK" in out, out[-4000:]
        for name, value in env.items():
            line = f"rank {rank} EFFECT {name}={value}"
            if rank == 0 or name not in RANK_0_ONLY:
                assert line in out, f"{line!r} not printed:\n{out[-4000:]}"
