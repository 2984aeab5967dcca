"""What a job prints for an uncaught spmd error (tests/programs/uncaught_error.py under
mpiexec): the traceback ends at the program's own line, spmd's frames left out with one
line saying so, type and message kept; SPMD_TRACEBACK=full shows spmd's frames."""

import re
import sys

import pytest
from _launch import ROOT, mpiexec, run

PROGRAM = "tests/programs/uncaught_error.py"
MESSAGE = "TypeError: all_reduce: tensor must be a numpy array"
LEFT_OUT = "  [frames inside spmd/ left out: SPMD_TRACEBACK=full shows them]"


def _call_line() -> int:
    with open(f"{ROOT}/{PROGRAM}") as f:
        return next(i for i, line in enumerate(f, 1) if "the call the traceback ends at" in line)


def _rank0_traceback(output: str, tagged: bool) -> list[str]:
    """Rank 0's lines (untagged) from "Traceback" to the exception's line."""
    if tagged:
        lines = [ln[len("[rank 0] "):] for ln in output.splitlines() if ln.startswith("[rank 0] ")]
    else:
        lines = output.splitlines()
    start = lines.index("Traceback (most recent call last):")
    end = next(i for i in range(start, len(lines)) if lines[i].startswith(MESSAGE))
    return lines[start:end + 1]


def _frames(lines: list[str]) -> list[tuple[str, int]]:
    out = []
    for line in lines:
        m = re.match(r'  File "([^"]+)", line (\d+), in ', line)
        if m:
            out.append((m[1].replace(ROOT + "/", ""), int(m[2])))
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("abort", ["1", "0"])
def test_the_traceback_ends_at_the_program_s_call(abort):
    """Aborting the job (rank-tagged lines), and without the abort (Python's own printing,
    untagged: one rank, so that no other rank's lines come between)."""
    n = 2 if abort == "1" else 1
    proc = run(mpiexec(n, sys.executable, PROGRAM), timeout=120,
               SPMD_ABORT_ON_EXCEPTION=abort)
    out = proc.stdout
    assert proc.returncode != 0, out
    assert "went on after the error" not in out, out
    lines = _rank0_traceback(out, tagged=abort == "1")
    assert _frames(lines)[-1] == (PROGRAM, _call_line()), out
    assert not any(f.startswith("spmd/") for f, _ in _frames(lines)), out
    assert lines[-2:] == [LEFT_OUT, lines[-1]], out
    assert "got list (wrap it with numpy.asarray) [rank 0, group WORLD]" in lines[-1]
    if abort == "1":
        assert "[rank 0] spmd: uncaught TypeError: aborting the MPI job" in out, out


@pytest.mark.timeout(200)
def test_full_traceback_shows_spmd_s_frames():
    proc = run(mpiexec(2, sys.executable, PROGRAM), timeout=120, SPMD_TRACEBACK="full")
    out = proc.stdout
    assert proc.returncode != 0, out
    lines = _rank0_traceback(out, tagged=True)
    frames = _frames(lines)
    assert frames[0] == (PROGRAM, _call_line()), out
    inside = [f for f, _ in frames[1:]]
    assert inside and all(f.startswith("spmd/") for f in inside), out
    assert "spmd/api/collectives.py" in inside, out
    assert LEFT_OUT not in lines
