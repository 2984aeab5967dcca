"""Differential test: spmd against torch.distributed (gloo), bit for bit.

tests/torch_diff/program.py runs one fixed sequence of collectives; this test runs it
under torchrun (``--impl torch``) and under mpiexec (``--impl spmd``) for world sizes
1 to 4 and checks that every rank saved the same arrays: same keys, dtypes, shapes
and bytes.  Plain pytest (not under mpiexec); skipped without torch or torchrun.

mpiexec is taken from $SPMD_MPIEXEC, then next to sys.executable, then from PATH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from _launch import clean_env, mpiexec, next_to_python

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
PROGRAM = os.path.join(TESTS, "torch_diff", "program.py")
RUN_TIMEOUT = 180  # seconds, per launch

torch = pytest.importorskip("torch", reason="torch is not installed: nothing to compare against")

pytestmark = pytest.mark.slow   # tests/run.sh rest, not README's quick command


def _torchrun() -> str | None:
    return next_to_python("torchrun") or shutil.which("torchrun")


def _env() -> dict:
    return clean_env()


def _launch(cmd: list[str], what: str) -> None:
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT, text=True)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
        pytest.fail(f"{what} did not finish within {RUN_TIMEOUT} s: {' '.join(cmd)}\n{out[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-6000:]}")


def _load(path: str) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _show(a: np.ndarray) -> str:
    return np.array2string(a, threshold=40, max_line_width=200) if a.ndim else repr(a[()])


def _diff(rank: int, ref: dict, got: dict) -> list[str]:
    errors = []
    for k in sorted(set(ref) - set(got)):
        errors.append(f"rank {rank}: key {k} only in torch's results")
    for k in sorted(set(got) - set(ref)):
        errors.append(f"rank {rank}: key {k} only in spmd's results")
    for k in sorted(set(ref) & set(got)):
        a, b = ref[k], got[k]
        if a.dtype.kind == b.dtype.kind == "U":  # repr of a Python value
            if a.shape != b.shape or a.tolist() != b.tolist():
                errors.append(f"rank {rank}: {k}: differs\n  torch: {a.tolist()}\n  spmd:  {b.tolist()}")
        elif a.dtype != b.dtype:
            errors.append(f"rank {rank}: {k}: dtype torch={a.dtype} spmd={b.dtype}")
        elif a.shape != b.shape:
            errors.append(f"rank {rank}: {k}: shape torch={a.shape} spmd={b.shape}")
        elif a.tobytes() != b.tobytes():
            errors.append(f"rank {rank}: {k}: values differ\n  torch: {_show(a)}\n  spmd:  {_show(b)}")
    return errors


@pytest.mark.timeout(400)
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_same_results_as_torch(nprocs, tmp_path):
    torchrun = _torchrun()
    if torchrun is None:
        pytest.skip("torchrun not found next to the Python interpreter or on PATH")
    tdir, sdir = tmp_path / "torch", tmp_path / "spmd"
    _launch([torchrun, "--standalone", f"--nproc-per-node={nprocs}", PROGRAM,
             "--impl", "torch", "--out", str(tdir)], f"torchrun ({nprocs} ranks)")
    _launch(mpiexec(nprocs, sys.executable, PROGRAM, "--impl", "spmd", "--out", str(sdir)),
            f"mpiexec ({nprocs} ranks)")
    errors = []
    for rank in range(nprocs):
        files = [d / f"rank{rank}.npz" for d in (tdir, sdir)]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            errors.append(f"rank {rank}: no results file {missing}")
            continue
        ref, got = (_load(str(f)) for f in files)
        if not ref:
            errors.append(f"rank {rank}: torch saved no results")
        errors += _diff(rank, ref, got)
    if errors:
        shown = "\n".join(errors[:60])
        more = f"\n... and {len(errors) - 60} more" if len(errors) > 60 else ""
        print(shown + more)
        pytest.fail(f"{len(errors)} differences between torch and spmd at world size "
                    f"{nprocs}:\n{shown}{more}")
