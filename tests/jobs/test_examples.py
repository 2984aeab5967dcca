"""The examples run under mpiexec at several sizes and check themselves against serial
computations; this test runs them (plain pytest, each job under a time limit)."""

import re
import sys

import pytest
from _docs import README, fenced
from _launch import mpiexec, run

# What the tour computed, checked on every rank (appended to the tour before its last
# line, destroy_process_group).
TOUR_CHECKS = """
import sys
s = world * (world - 1) / 2
assert (x == s).all(), x          # the sum, averaged, then broadcast
assert (out == np.repeat(np.arange(world), 2)).all(), out
assert pair.size() == min(world, 2) if rank < 2 else pair == dist.GroupMember.NON_GROUP_MEMBER
assert pg.size() == (2 if world % 2 == 0 else 1) and len(subgroups) == world // pg.size()
assert objs == [{"rank": r} for r in range(world)], objs
sys.stdout.write(f"rank {rank}/{world} tour OK\\n")
sys.stdout.flush()
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_quickstart(n):
    proc = run(mpiexec(n, sys.executable, "examples/quickstart.py"), timeout=120)
    assert proc.returncode == 0, proc.stdout
    lines = sorted(re.findall(r"rank (\d+)/(\d+) quickstart OK", proc.stdout))
    assert lines == sorted((str(r), str(n)) for r in range(n)), proc.stdout


@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_the_tour_runs_as_shown(n, tmp_path):
    """README's tour (the same text as docs/tour.md's) at every size it says it runs at."""
    tour = fenced(README, "python", "## A tour").rstrip("\n").splitlines()
    assert tour[-1] == "dist.destroy_process_group()", tour[-1]
    program = tmp_path / "tour.py"
    program.write_text("\n".join(tour[:-1]) + TOUR_CHECKS + tour[-1] + "\n")
    proc = run(mpiexec(n, sys.executable, str(program)), timeout=120)
    assert proc.returncode == 0, proc.stdout
    lines = sorted(re.findall(r"rank (\d+)/(\d+) tour OK", proc.stdout))
    assert lines == sorted((str(r), str(n)) for r in range(n)), proc.stdout


QUICKSTART_LINE = re.compile(
    r"quickstart on 4 rank\(s\)"
    r"|  check +passed on"
    r"|  (?P<check>\S.*?) +(\d+/\d+ ranks|- \(needs 2 ranks\))"
    r"|rank (?P<rank>\d)/4 quickstart OK")


@pytest.mark.timeout(300)
def test_quickstart_lines_are_whole():
    """Unbuffered output is where print() writes text and newline apart and ranks' lines
    ran together; every line must come out whole, the table in one piece on rank 0."""
    for _ in range(5):
        proc = run(mpiexec(4, sys.executable, "examples/quickstart.py"), timeout=120,
                   PYTHONUNBUFFERED="1")
        assert proc.returncode == 0, proc.stdout
        lines = proc.stdout.splitlines()
        matches = [QUICKSTART_LINE.fullmatch(ln) for ln in lines]
        assert all(matches), [ln for ln, m in zip(lines, matches) if not m]
        assert sorted(m["rank"] for m in matches if m["rank"]) == ["0", "1", "2", "3"]
        table = [i for i, m in enumerate(matches) if not m["rank"]]
        assert table == list(range(table[0], table[0] + 9)), proc.stdout  # contiguous
        checks = [m["check"] for m in matches if m["check"]]
        assert len(checks) == 7 and "isend/irecv around a ring" in checks, checks


@pytest.mark.timeout(120)
def test_parallel_example_lines_are_whole():
    proc = run(mpiexec(4, sys.executable, "examples/tp_mlp.py"), timeout=90,
               PYTHONUNBUFFERED="1")
    assert proc.returncode == 0, proc.stdout
    line = re.compile(r"rank (\d)/4 tp_mlp OK max_err=\S+ hidden units \d+:\d+ of \d+")
    lines = proc.stdout.splitlines()
    assert all(line.fullmatch(ln) for ln in lines), lines
    assert sorted(line.fullmatch(ln)[1] for ln in lines) == ["0", "1", "2", "3"]


def test_write_lines_writes_each_line_once_whole():
    from spmd.core.lines import write_lines

    class Recorder:
        def __init__(self):
            self.writes, self.flushes = [], 0

        def write(self, text):
            self.writes.append(text)

        def flush(self):
            self.flushes += 1

    out = Recorder()
    write_lines("[rank 2] first\n[rank 2] second", out)
    write_lines("", out)
    assert out.writes == ["[rank 2] first\n", "[rank 2] second\n", "\n"]
    assert out.flushes == 3


def run_example(name, n, *args, timeout=60):
    """Run examples/<name>.py on n ranks; each rank must print its own OK line."""
    proc = run(mpiexec(n, sys.executable, f"examples/{name}.py", *args), timeout=timeout)
    assert proc.returncode == 0, proc.stdout
    lines = sorted(re.findall(rf"rank (\d+)/(\d+) {name} OK", proc.stdout))
    assert lines == sorted((str(r), str(n)) for r in range(n)), proc.stdout
    return proc.stdout


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["dp_mlp", "tp_mlp", "pp_1f1b"])
def test_parallel_example(name, n):
    run_example(name, n)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("bucket_bytes, buckets", [(1, 6), (1 << 20, 1)])
def test_dp_mlp_bucket_sizes(bucket_bytes, buckets):
    # One bucket per parameter, and one bucket for the whole model.
    out = run_example("dp_mlp", 3, "--bucket-bytes", str(bucket_bytes))
    assert out.count(f"buckets={buckets} ") == 3, out


@pytest.mark.timeout(120)
def test_three_d():
    run_example("three_d", 8, timeout=90)
