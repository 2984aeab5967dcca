"""A rank whose program ends while the others wait in a collective with it
(tests/programs/exit_early.py): the others hear it within seconds, on every MPI, instead
of waiting out the 30-minute group timeout, then shrink WORLD without it and go on
(under ULFM the exited process leaves without MPI_Finalize: a failed rank).
"""

from __future__ import annotations

import re
import sys

import pytest
from _launch import mpiexec, mpiexec_prefix, run

PROGRAM = "tests/programs/exit_early.py"
HEARD_WITHIN = 5.0   # seconds: the notice is milliseconds; room for a loaded machine


def _heard(out: str, n: int, error: str) -> None:
    lines = [line for line in out.splitlines() if line.startswith("heard: ")]
    assert len(lines) == n - 1, out
    for line in lines:
        if error == "ProcessFailedError" and "GroupBrokenError" in line:
            # Under ULFM the exit's notice can come before MPI's report of the failure.
            assert f"rank {n - 1} exited the program (pid " in line, out
            continue
        assert line.startswith(f"heard: {error}: all_reduce: "), out
        if error == "ProcessFailedError":
            assert f"rank(s) [{n - 1}] of group WORLD failed" in line, out
        else:
            assert f"rank {n - 1} exited the program (pid " in line, out
    assert out.count("shrunk and went on") == n - 1, out
    times = [float(t) for t in re.findall(r"^after ([\d.]+) s$", out, re.M)]
    assert len(times) == n - 1 and max(times) < HEARD_WITHIN, out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3])
def test_exit_is_heard_at_once(n):
    proc = run(mpiexec(n, sys.executable, PROGRAM), timeout=60)
    assert proc.returncode == 0, proc.stdout
    _heard(proc.stdout, n, "GroupBrokenError")


@pytest.mark.timeout(90)
def test_exit_under_ulfm():
    exe, *flags = mpiexec_prefix()
    if "--oversubscribe" not in flags:
        pytest.skip(f"ULFM needs Open MPI's mpiexec (--with-ft ulfm); this one is {exe}")
    proc = run([exe, "--with-ft", "ulfm", *flags, "-n", "3", sys.executable, PROGRAM],
               timeout=60)
    assert proc.returncode == 0, proc.stdout
    _heard(proc.stdout, 3, "ProcessFailedError")
