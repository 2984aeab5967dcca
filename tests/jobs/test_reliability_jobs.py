"""Jobs that go wrong on purpose, each its own mpiexec under a hard wall-clock limit:
a rank that skips a collective, raises, or is killed; mismatched calls under
SPMD_DEBUG=DETAIL; flight recorder dumps and their reader; the soak run.

A failure here can never hang the suite: every job runs under ``run(..., timeout=)``
and every test under pytest-timeout.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import time

import pytest
from _launch import mpiexec, run

PROGRAMS = "tests/programs"
TIMEOUT = 2.0   # the group timeout skip_collective.py sets
SLACK = 5.0     # diagnosis, start-up jitter on a loaded machine


def job(n, program, *args, timeout=60, **env):
    t0 = time.monotonic()
    proc = run(mpiexec(n, sys.executable, f"{PROGRAMS}/{program}", *args), timeout=timeout, **env)
    return proc, time.monotonic() - t0


def _status(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return f.read().lower()
    except OSError:  # gone meanwhile
        return "zombie"


@pytest.mark.timeout(90)
def test_skipped_collective_times_out_naming_the_missing_rank():
    proc, _ = job(3, "skip_collective.py", "catch")
    out = proc.stdout
    assert proc.returncode != 0, out
    for rank in (0, 1):
        m = re.search(rf"rank {rank} raised DistTimeoutError after ([\d.]+) s:", out)
        assert m, out
        assert TIMEOUT <= float(m.group(1)) < TIMEOUT + SLACK, out
        assert (f"all_reduce: did not complete within 2.0 s (collective #2 on group WORLD, MPI, "
                f"group timeout 2 s) [rank {rank}, group WORLD]") in out
        assert f"rank {rank} then: GroupBrokenError: all_reduce: group WORLD is broken" in out
    assert "ranks that have not reached all_reduce #2:" in out
    # where the missing rank is instead: its last op, and the line it is sleeping on
    assert ("rank 2: last finished all_reduce #1" in out
            and "skip_collective.py:22 in <module>: time.sleep(60)" in out), out


@pytest.mark.timeout(90)
def test_an_escaping_timeout_aborts_the_job():
    proc, elapsed = job(3, "skip_collective.py")
    out = proc.stdout
    assert proc.returncode != 0, out
    assert elapsed < 30, (elapsed, out)  # the straggler sleeps 60 s: it was killed
    assert re.search(r"\[rank [01]\] spmd\.core\.errors\.DistTimeoutError: all_reduce: did not "
                     r"complete within 2\.0 s", out), out
    assert re.search(r"\[rank [01]\] spmd: uncaught DistTimeoutError: aborting the MPI job", out)


@pytest.mark.timeout(90)
def test_an_uncaught_exception_aborts_the_job_with_its_traceback():
    proc, elapsed = job(3, "raise_one_rank.py")
    out = proc.stdout
    assert proc.returncode != 0, out
    assert elapsed < 30, (elapsed, out)  # the others waited in a barrier with a 30 min timeout
    assert "[rank 1] Traceback (most recent call last):" in out
    assert '[rank 1]     raise ValueError("boom on purpose")' in out
    assert "[rank 1] ValueError: boom on purpose" in out
    assert "[rank 1] spmd: uncaught ValueError: aborting the MPI job" in out
    assert "passed the barrier" not in out


@pytest.mark.timeout(90)
def test_abort_on_exception_can_be_turned_off(tmp_path):
    proc, _ = job(2, "all_raise.py", str(tmp_path), SPMD_ABORT_ON_EXCEPTION="0")
    assert proc.returncode != 0, proc.stdout
    assert "aborting the MPI job" not in proc.stdout, proc.stdout
    for rank in (0, 1):  # Python's own traceback, untagged, and nothing from spmd
        err = (tmp_path / f"rank{rank}.err").read_text()
        assert "aborting the MPI job" not in err and "[rank " not in err, err
        assert err.count("Traceback (most recent call last):") == 1, err
        assert err.rstrip().endswith(f"RuntimeError: every rank fails: rank {rank}"), err


@pytest.mark.timeout(90)
def test_a_killed_rank_ends_the_job_and_leaves_no_rank_behind():
    proc, elapsed = job(3, "kill_one_rank.py")
    out = proc.stdout
    assert proc.returncode != 0, out
    assert elapsed < 30, (elapsed, out)
    pids = [int(p) for p in re.findall(r"rank \d pid (\d+)", out)]
    assert len(pids) == 3, out
    time.sleep(0.5)
    alive = [p for p in pids if os.path.exists(f"/proc/{p}") and "zombie" not in _status(p)]
    assert not alive, f"ranks left running: {alive}\n{out}"
    assert "passed the barrier" not in out


@pytest.mark.timeout(90)
def test_mismatched_calls_raise_on_every_rank_in_debug_mode():
    proc, _ = job(3, "debug_mismatch.py", SPMD_DEBUG="DETAIL")
    out = proc.stdout
    assert proc.returncode == 0, out
    expect = {
        "shape": "shape: (3,) on ranks 0,1 but (4,) on rank 2",
        "dtype": "dtype: float64 on ranks 0,1 but float32 on rank 2",
        "op": "op: all_reduce on ranks 0,1 but broadcast on rank 2",
        "root": "root (global rank): 0 on ranks 0,1 but 1 on rank 2",
        "reduce_op": "reduce_op: SUM on ranks 0,1 but MAX on rank 2",
    }
    for rank in range(3):
        for case, detail in expect.items():
            line = next((ln for ln in out.splitlines() if ln.startswith(f"rank {rank} {case}: ")),
                        None)
            assert line is not None and "NO ERROR" not in line, out
            assert "called collective #" in line and detail in line, line
        assert f"rank {rank} done" in out


@pytest.mark.timeout(90)
def test_flight_recorder_dumps_are_private_and_merge(tmp_path):
    dumps = tmp_path / "dumps"
    proc, _ = job(3, "skip_collective.py", "catch", SPMD_DUMP_DIR=str(dumps))
    assert proc.returncode != 0, proc.stdout
    files = sorted(os.listdir(dumps))
    assert files == [f"spmd_fr.rank{r}.json" for r in range(3)], (files, proc.stdout)
    for f in files:
        assert stat.S_IMODE(os.stat(dumps / f).st_mode) == 0o600
        assert json.loads((dumps / f).read_text())["format"] == "spmd-flight-recorder"
    assert stat.S_IMODE(os.stat(dumps).st_mode) == 0o700
    reader = run([sys.executable, "-m", "spmd.tools.fr_trace", str(dumps)], timeout=60)
    assert reader.returncode == 0, reader.stdout
    text = reader.stdout
    assert "first divergence at collective #2: not every rank finished it" in text, text
    assert "ranks 0,1: all_reduce 4 x float64 (started, timed out)" in text, text
    assert "rank 2: never started #2" in text, text


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_soak_mixed_ops_over_several_groups_stays_flat():
    proc, _ = job(3, "soak.py", "20000", timeout=150)
    out = proc.stdout
    assert proc.returncode == 0, out
    for rank in range(3):
        m = re.search(rf"rank {rank} soak OK: (\d+) ops", out)
        assert m and int(m.group(1)) >= 20000, out


@pytest.mark.timeout(120)
@pytest.mark.same_on_every_mpi   # the device double's NCCL and the watchdog, idle
@pytest.mark.parametrize("n", [1, 3])
def test_idle_nccl_job_keeps_its_groups(n):
    """NCCL ops (on the device double), then 4 s idle past a 1 s timeout: the job goes on
    with the same groups and the watchdog reports nothing."""
    proc, _ = job(n, "nccl_idle.py", "--double", timeout=90)
    out = proc.stdout
    assert proc.returncode == 0, out
    assert out.count("nccl_idle OK") == n, out
    assert "spmd watchdog" not in out, out


@pytest.mark.timeout(90)
def test_a_hung_rank_without_ulfm_ends_the_job_with_the_diagnosis():
    """Without ULFM nothing is ended: the survivors get the diagnosis naming the stopped
    rank, and the job ends (the stopped rank with it)."""
    proc, took = job(3, "hang_one_rank.py", "stop", "2", timeout=60)
    out = proc.stdout
    assert proc.returncode != 0, out
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines()
               if line.startswith("RESULT ")]
    # The first survivor to finish its diagnosis raises it and ends the job (MPI_Abort),
    # which may take the other survivor down before it prints: at least one RESULT.
    # A survivor gets its own diagnosis, or the group broken by the other one first.
    ranks = sorted(r["rank"] for r in results)
    assert ranks and set(ranks) <= {0, 1}, out
    for r in results:
        assert r["error"] == "DistTimeoutError" or (
            r["error"] == "GroupBrokenError"
            and re.search(r"\(told by rank [01]\)", r["text"])), out
    assert any(r["error"] == "DistTimeoutError" for r in results), out
    assert "rank 2: not responding" in out, out
    assert "are ended so that MPI reports them failed" not in out, out
