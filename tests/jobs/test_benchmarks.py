"""Every CPU benchmark program runs to its table at its smallest settings, so one that
no longer runs is found here and not when someone needs its figures.  (The figures
themselves are read by people, not asserted: these machines are shared and noisy.)"""

import importlib.util
import sys

import pytest
from _launch import mpiexec, run

CASES = [
    (["overhead.py", "--iters", "50", "--repeats", "1"], "ratio spmd/mpi4py"),
    (["shm_allreduce.py", "--sizes", "4K", "--rounds", "1"], "MPI/spmd"),
    (["checkpoint_io.py", "--mib", "2", "--repeat", "1", "--no-torch"], "np.save/rank"),
    (["dp_step.py", "--width", "32", "--layers", "2", "--steps", "2"], "after backward"),
    (["mesh_setup.py", "--shape", "2", "1", "--repeats", "1"], "ratio new_group/mesh"),
    (["ddp_step.py", "--hidden", "32", "--steps", "2", "--warmup", "1"], "torch-spmd"),
]
SLOW = {"ddp_step.py"}   # imports torch on both ranks: tests/run.sh rest
PARAMS = [pytest.param(args, expected, id=args[0],
                       marks=[pytest.mark.slow] if args[0] in SLOW else [])
          for args, expected in CASES]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, expected", PARAMS)
def test_benchmark_runs_to_its_table(args, expected):
    if args[0] == "ddp_step.py" and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    proc = run(mpiexec(2, sys.executable, f"benchmarks/{args[0]}", *args[1:]), timeout=90)
    assert proc.returncode == 0, proc.stdout
    assert expected in proc.stdout, proc.stdout
