"""MPMD jobs of their own: two different scripts in one mpiexec
(tests/programs/mpmd_left.py : mpmd_right.py), the ocean/atmosphere example, debug mode
over a link (tests/programs/mpmd_debug.py), and the choice between device pointer and
host staging for GPU arrays on links (the in-job tests: tests/mpi/test_mpmd.py)."""

import re
import sys

import pytest
from _launch import mpiexec_prefix, run


@pytest.mark.timeout(200)
@pytest.mark.parametrize("left, right", [(1, 1), (2, 2), (1, 3)])
def test_link_debug_mode_two_programs(left, right):
    prog = "tests/programs/mpmd_debug.py"
    cmd = list(mpiexec_prefix())
    for i, (n, name) in enumerate(((left, "left"), (right, "right"))):
        cmd += ([":"] if i else []) + ["-n", str(n), sys.executable, prog, name]
    proc = run(cmd, timeout=120, SPMD_DEBUG="DETAIL")
    assert proc.returncode == 0, proc.stdout[-4000:]
    for w in range(left + right):
        for case in ("shape", "src_program", "op"):
            line = re.search(rf"^rank {w} {case}: (.*)$", proc.stdout, re.MULTILINE)
            assert line and "called link operation #" in line.group(1) and \
                f"different arguments: {case}: " in line.group(1), (w, case, proc.stdout)
        assert re.search(rf"^rank {w} matched: OK$", proc.stdout, re.MULTILINE), proc.stdout


def _mpmd(*parts, timeout=120):
    """mpiexec -n a prog1 args : -n b prog2 args (Hydra and Open MPI syntax)."""
    cmd = list(mpiexec_prefix())
    for i, (n, *args) in enumerate(parts):
        cmd += ([":"] if i else []) + ["-n", str(n), sys.executable, *args]
    return run(cmd, timeout=timeout)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("left, right", [(1, 1), (2, 3)])
def test_two_scripts_in_one_job(left, right):
    proc = _mpmd((left, "tests/programs/mpmd_left.py"), (right, "tests/programs/mpmd_right.py"))
    assert proc.returncode == 0, proc.stdout[-4000:]
    got = sorted(re.findall(r"^(left|right) (\d+)/(\d+) mpmd OK$", proc.stdout, re.MULTILINE))
    assert got == sorted([("left", str(r), str(left)) for r in range(left)]
                         + [("right", str(r), str(right)) for r in range(right)]), proc.stdout


@pytest.mark.timeout(200)
@pytest.mark.parametrize("ocean, atmos", [(2, 2), (1, 3), (3, 2)])
def test_ocean_atmosphere_example(ocean, atmos):
    proc = _mpmd((ocean, "examples/mpmd_ocean.py"), (atmos, "examples/mpmd_atmos.py"))
    assert proc.returncode == 0, proc.stdout[-4000:]
    for prog, n in (("ocean", ocean), ("atmos", atmos)):
        ranks = sorted(int(r) for r in re.findall(
            rf"^{prog} rank (\d+)/{n} coupled OK", proc.stdout, re.MULTILINE))
        assert ranks == list(range(n)), proc.stdout
    assert re.search(rf"^programs: ocean ranks \[{', '.join(map(str, range(ocean)))}\]",
                     proc.stdout, re.MULTILINE), proc.stdout
