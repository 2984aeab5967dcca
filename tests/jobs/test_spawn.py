"""spmd.spawn: jobs started from a plain ``python`` (no launcher, the venv's bin not on
PATH), each program under a wall-clock limit; results checked against numpy, faults
against the process table."""

import json
import os
import re
import subprocess
import sys

import pytest
from _launch import ROOT, clean_env

PROGRAM = os.path.join("tests", "programs", "spawn_jobs.py")


def run_mode(mode: str, timeout: float = 150, **env: str):
    """Run spawn_jobs.py MODE with plain python and PATH without the environment's bin."""
    e = clean_env(**env)
    e["PATH"] = os.pathsep.join(p for p in e.get("PATH", "").split(os.pathsep)
                                if p and not os.path.isfile(os.path.join(p, "mpiexec")))
    e.pop("SPMD_MPIEXEC", None)
    proc = subprocess.run([sys.executable, PROGRAM, mode], check=False, cwd=ROOT, env=e,
                          timeout=timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    checks = {}
    for line in proc.stdout.splitlines():
        if line.startswith('{"check"'):
            row = json.loads(line)
            checks.setdefault(row["check"], []).append(row)
    return proc, checks


def run_with(pickler: str, mode: str):
    """run_mode with cloudpickle (skipped without it) or with plain pickle."""
    if pickler == "cloudpickle":
        pytest.importorskip("cloudpickle")
    return run_mode(mode, **({"SPAWN_TEST_NO_CLOUDPICKLE": "1"} if pickler == "pickle" else {}))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("pickler", ["cloudpickle", "pickle"])
def test_sizes_1_to_4_match_numpy(pickler):
    proc, checks = run_with(pickler, "sizes")
    assert proc.returncode == 0, proc.stdout
    assert [(c["n"], c["ok"]) for c in checks["sizes"]] == [(1, True), (2, True), (3, True),
                                                             (4, True)], proc.stdout
    assert checks["left"][0]["workers"] == [], proc.stdout


@pytest.mark.timeout(120)
def test_readme_example():
    proc, checks = run_mode("readme")
    assert proc.returncode == 0, proc.stdout
    assert checks["readme"][0]["results"] == pytest.approx([0.6] * 4), proc.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pickler", ["cloudpickle", "pickle"])
def test_exception_names_rank_with_traceback_and_ends_the_others(pickler):
    proc, checks = run_with(pickler, "raise")
    assert proc.returncode == 0, proc.stdout
    row = checks["raise"][0]
    assert (row["type"], row["rank"], row["error_type"]) == (
        "ProcessRaisedException", 1, "ValueError"), row
    assert "rank 1 of 3" in row["message"] and "bad value on rank 1" in row["message"]
    assert "-- traceback of rank 1 --" in row["message"]
    # Both frames name the script's file and lines, whether the functions went by value
    # (cloudpickle) or by reference (plain pickle).
    frames = re.findall(r'File "([^"]*)", line \d+, in (\w+)', row["message"])
    assert [(os.path.basename(f), name) for f, name in frames[-2:]] == [
        ("spawn_jobs.py", "raise_on_one"), ("spawn_jobs.py", "refuse")], row["message"]
    assert "<dynamic-code>" not in row["message"]
    assert row["workers"] == [], row  # ranks 0 and 2 (stuck in all_reduce) were ended
    assert row["seconds"] < 30, row
    assert checks["after"][0]["results"] == [1.0, 1.0], proc.stdout
    assert checks["left"][0]["workers"] == [], proc.stdout


@pytest.mark.timeout(120)
def test_killed_rank_reported_within_seconds_none_left():
    proc, checks = run_mode("kill")
    row = checks["kill"][0]
    assert "died without reporting" in row["message"] and "2" in row["message"], row
    assert row["seconds"] < 15, row
    assert row["workers"] == [], row
    # Hydra ended the job; nothing spawned is left below the parent.
    assert not any("spmd_spawn_boot" in c or "hydra_pmi_proxy" in c
                   for c in row["descendants"]), row
    assert "restart the interpreter" in checks["again"][0]["message"], proc.stdout


@pytest.mark.timeout(120)
def test_timeout_bounds_the_job():
    proc, checks = run_mode("timeout")
    assert proc.returncode == 0, proc.stdout
    row = checks["timeout"][0]
    assert "did not finish within its timeout" in row["message"], row
    assert 3 <= row["seconds"] < 15, row
    assert row["workers"] == [], row
    assert checks["after"][0]["results"] == [1.0, 1.0], proc.stdout


@pytest.mark.timeout(300)
def test_ten_spawns_leak_no_processes_or_fds():
    proc, checks = run_mode("repeat", timeout=280)
    assert proc.returncode == 0, proc.stdout
    row = checks["repeat"][0]
    assert row["ok"], row
    assert row["fds_after"] == row["fds_before"], row
    assert row["procs_after"] == row["procs_before"], row
    assert row["workers"] == [], row


@pytest.mark.timeout(120)
def test_join_false_context():
    proc, checks = run_mode("nojoin")
    assert proc.returncode == 0, proc.stdout
    row = checks["nojoin"][0]
    assert row["first"] is False and row["polls"] >= 1, row
    assert row["results"] == [5, 5, 5], row  # 0 + 1 + 4 on every rank
    assert all(isinstance(p, int) for p in row["pids"]), row
    assert row["workers"] == [], row


@pytest.mark.timeout(60)
def test_bad_input_raises_before_anything_starts():
    proc, checks = run_mode("badinput", SPAWN_TEST_NO_CLOUDPICKLE="1")
    assert proc.returncode == 0, proc.stdout
    msgs = checks["badinput"][0]["messages"]
    assert msgs[0].startswith("TypeError: spawn: fn must be callable, got int"), msgs
    assert msgs[1] == "ValueError: spawn: nprocs must be a positive int, got 0", msgs
    assert msgs[2].startswith("TypeError: spawn: args must be a tuple, got int"), msgs
    assert msgs[3].startswith("ValueError: spawn: timeout must be a positive"), msgs
    assert msgs[4].startswith("TypeError: spawn: env must map str to str"), msgs
    assert "need cloudpickle" in msgs[5], msgs
    assert checks["badinput"][0]["workers"] == []


@pytest.mark.timeout(60)
def test_env_reaches_children():
    proc, checks = run_mode("env", SPAWN_TEST_NO_CLOUDPICKLE="1")
    assert proc.returncode == 0, proc.stdout
    assert checks["env"][0]["results"] == ["hello:0", "hello:1"], proc.stdout


@pytest.mark.timeout(60)
def test_refused_inside_a_multi_rank_job():
    from _launch import mpiexec, run
    # Rank 0 prints every rank's refusal: lines of two ranks sharing mpiexec's stdout can
    # interleave inside a line.
    code = ("import spmd\nfrom mpi4py import MPI\ntry:\n    spmd.spawn(print, nprocs=1)\n"
            "except RuntimeError as e:\n    said = f'REFUSED {e}'\nelse:\n    said = 'not refused'\n"
            "lines = MPI.COMM_WORLD.gather(said)\n"
            "if lines:\n    print('\\n'.join(lines), flush=True)\n")
    proc = run(mpiexec(2, sys.executable, "-c", code), timeout=60)
    assert proc.stdout.count("REFUSED spawn: this process is rank") == 2, proc.stdout
    assert "of an MPI job of 2 ranks" in proc.stdout


class _LateComm:
    """An intercommunicator whose one message (rank 0's result) arrives on the third probe."""

    def __init__(self, data):
        self.data, self.probes = data, 0

    def improbe(self, source, tag, status):
        from spmd.spawn.child import RESULT

        self.probes += 1
        if self.probes != 3:
            return None
        status.Set_source(0)
        status.Set_tag(RESULT)
        data = self.data

        class Message:
            def recv(self):
                return data
        return Message()


def test_result_arriving_after_the_process_is_gone_is_a_finished_rank():
    """A rank sends its result and exits at once; MPI may deliver the message after the
    parent sees the process gone: that rank finished, it did not die.  A rank whose
    result never comes is reported dead after the grace."""
    import pickle
    import socket
    import time

    from spmd.spawn import parent as sp

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid with no process behind it
    for data, finished in (("ok", True), (None, False)):
        comm = _LateComm(("ok", pickle.dumps(42)) if data else None)
        if data is None:
            comm.improbe = lambda source, tag, status: None
        ctx = sp.ProcessContext(comm, 1, None, None)
        ctx._pids[0], ctx._hosts[0] = gone.pid, socket.gethostname()
        t0 = time.monotonic()
        problem = ctx._check(t0)
        if finished:
            assert problem is None and ctx._replied == {0} and ctx._values[0] == 42
            assert time.monotonic() - t0 < sp._LATE_RESULT
        else:
            assert isinstance(problem, sp.ProcessExitedException), problem
            assert "rank 0 of 1" in str(problem) and "died without reporting" in str(problem)
            assert time.monotonic() - t0 >= sp._LATE_RESULT
