"""How the GPU support is installed and checked, tested without a GPU: CuPy is not
loaded by host-only programs, the CUDA extras, tests/mpi_pytest.py without pytest-mpi,
and tests/gpu/run.sh on a machine without a GPU (it must say so quickly, not crash)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A 'cupy' that leaves a mark when something tries to import it, then fails to import.
FAKE_CUPY = """
import os
open(os.environ["CUPY_MARK"], "a").write("imported\\n")
raise ImportError("this cupy is a stand-in that must not be imported")
"""

HOST_ONLY = """
import sys
import numpy as np
import spmd
spmd.init_process_group()
x = np.ones(3)
spmd.all_reduce(x)
g = spmd.new_group()
spmd.all_reduce(x, group=g)
spmd.barrier()
assert x[0] == 1.0
print("cupy in sys.modules after host work:", "cupy" in sys.modules)
print("backend:", spmd.get_backend())  # resolving the default may look for CuPy
spmd.destroy_process_group()
"""


def _run(args, env=None, timeout=60):
    return subprocess.run(args, cwd=ROOT, env={**os.environ, **(env or {})}, timeout=timeout,
                          capture_output=True, text=True, check=False)


def test_host_only_programs_never_load_cupy(tmp_path):
    """init_process_group(backend=None) decides the GPU backend at the first GPU array:
    a program that moves host arrays never imports CuPy (nor loads libnccl)."""
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(FAKE_CUPY)
    mark = tmp_path / "mark"
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "CUPY_MARK": str(mark)}
    proc = _run([sys.executable, "-c", HOST_ONLY], env)
    assert proc.returncode == 0, proc.stderr
    assert "cupy in sys.modules after host work: False" in proc.stdout
    # get_backend() resolves the default: only then is CuPy looked for, once
    assert "backend: mpi" in proc.stdout
    assert mark.read_text() == "imported\n"


def test_cuda_extras():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for cuda in ("12", "13"):
        names = " ".join(extras[f"cuda{cuda}"])
        assert f"cupy-cuda{cuda}x" in names and f"nvidia-nccl-cu{cuda}" in names
        assert "ml_dtypes" in names
    assert "cupy-cuda12x>=13.4" in extras["cuda12"]  # older CuPy overflows 2 GiB broadcasts


BLOCK_PYTEST_MPI = """
import runpy, sys

sys.modules["pytest_mpi"] = None  # as if not installed: find_spec None, import fails
sys.argv = ["tests/mpi_pytest.py", *sys.argv[1:]]
runpy.run_path("tests/mpi_pytest.py", run_name="__main__")
"""


def test_mpi_pytest_runs_without_pytest_mpi(tmp_path):
    """A bare GPU machine may lack pytest-mpi: the mpi-marked tests run all the same
    (pytest-mpi's --with-mpi would be an unknown option there)."""
    proc = _run([sys.executable, "-c", BLOCK_PYTEST_MPI, str(tmp_path), "-q",
                 "-p", "no:cacheprovider", "-m", "mpi", "tests/mpi/test_world.py"],
                {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_gpu_check_script_without_a_gpu(tmp_path):
    """On a machine without a GPU (or CuPy) tests/gpu/run.sh says so in its last line,
    exits 2 (not run) within seconds, and leaves its logs in $OUT."""
    script = ROOT / "tests" / "gpu" / "run.sh"
    assert _run(["bash", "-n", str(script)]).returncode == 0
    start = time.monotonic()
    proc = _run(["bash", str(script)], {"OUT": str(tmp_path), "PYTHON": sys.executable,
                                         "PYTHONPATH": str(tmp_path / "nothing")}, timeout=120)
    took = time.monotonic() - start
    from spmd.core import cuda as _gpu

    if _gpu.cupy_or_none() is not None:
        pytest.skip("CuPy is importable here: the script would run the real check")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("GPU check: not run (no GPU: ") and "cupy" in last, last
    assert took < 60
    logs = tmp_path / "gpu-check"
    assert (logs / "summary.txt").read_text().strip().splitlines()[-1] == last
    assert "No module named 'cupy'" in (logs / "cupy.log").read_text()


def test_gpu_check_script_fits_one_device_call():
    """Every step runs under what is left of BUDGET (default 540 s), so the summary is
    printed before a 600 s device call ends; the wheels are installed with --prefix."""
    text = (ROOT / "tests" / "gpu" / "run.sh").read_text()
    assert "BUDGET=${BUDGET:-540}" in text
    assert "timeout -k 5 \"$t\"" in text and "LIMIT=900" not in text
    assert "--prefix \"$DEPS\"" in text and "--no-index" in text
    assert "pip download --no-deps --only-binary=:all: --python-version 3.12" in text
    assert ".whl/" in (ROOT / ".gitignore").read_text()


def test_gpu_example_without_cupy(tmp_path):
    """examples/dp_mlp_gpu.py (what slurm/gpu.sbatch runs) needs CuPy and a GPU; without
    them it says so and exits with 2 rather than failing somewhere inside."""
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(FAKE_CUPY)
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "CUPY_MARK": str(tmp_path / "mark")}
    proc = _run([sys.executable, "examples/dp_mlp_gpu.py"], env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "dp_mlp_gpu: needs CuPy and a CUDA GPU (ImportError: this cupy is a stand-in" \
        in proc.stderr
    assert "spmd[cuda12]" in proc.stderr
    sbatch = (ROOT / "slurm" / "gpu.sbatch").read_text()
    assert "examples/dp_mlp_gpu.py" in sbatch and "examples/quickstart.py" not in sbatch
