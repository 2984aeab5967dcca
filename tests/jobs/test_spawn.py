"""spmd.spawn: jobs started from a plain ``python`` (no launcher, the venv's bin not on
PATH), each program under a wall-clock limit; results checked against numpy, faults
against the process table.  They run on whichever MPI this environment has (MPICH, Open
MPI, Intel MPI): spawn starts that library's own mpiexec."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest
from _launch import ROOT, clean_env, slurm_unavailable, srun_cannot_start_ranks, srun_mpi

PROGRAM = os.path.join("tests", "programs", "spawn_jobs.py")
# How fn travels to the ranks cannot depend on the MPI library: plain pickle's runs only
# on the first MPI tests/run.sh tests.
PICKLERS = ["cloudpickle", pytest.param("pickle", marks=pytest.mark.same_on_every_mpi)]


def run_mode(mode: str, timeout: float = 150, prefix: tuple[str, ...] = (), **env: str):
    """Run spawn_jobs.py MODE with plain python (after ``prefix``, as salloc's command) and
    PATH without the environment's bin."""
    e = clean_env(**env)
    e["PATH"] = os.pathsep.join(p for p in e.get("PATH", "").split(os.pathsep)
                                if p and not os.path.isfile(os.path.join(p, "mpiexec")))
    e.pop("SPMD_MPIEXEC", None)
    proc = subprocess.run([*prefix, sys.executable, PROGRAM, mode], check=False, cwd=ROOT, env=e,
                          timeout=timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    checks = {}
    for line in proc.stdout.splitlines():
        if line.startswith('{"check"'):
            row = json.loads(line)
            checks.setdefault(row["check"], []).append(row)
    return proc, checks


def _nodes_on_loopback() -> bool:
    """Whether every node of the SLURM cluster is this host (their addresses loopback)."""
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%o"], capture_output=True, text=True,
                         timeout=30, check=False)
    addresses = out.stdout.split()
    return bool(addresses) and all(a.startswith("127.") for a in addresses)


def run_with(pickler: str, mode: str):
    """run_mode with cloudpickle (skipped without it) or with plain pickle."""
    if pickler == "cloudpickle":
        pytest.importorskip("cloudpickle")
    return run_mode(mode, **({"SPAWN_TEST_NO_CLOUDPICKLE": "1"} if pickler == "pickle" else {}))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("pickler", PICKLERS)
def test_sizes_1_to_4_match_numpy(pickler):
    proc, checks = run_with(pickler, "sizes")
    assert proc.returncode == 0, proc.stdout
    assert [(c["n"], c["ok"]) for c in checks["sizes"]] == [(1, True), (2, True), (3, True),
                                                             (4, True)], proc.stdout
    left = checks["left"][0]
    assert left["workers"] == [] and left["descendants"] == [], proc.stdout
    assert left["mpi_in_caller"] is False, proc.stdout


@pytest.mark.timeout(120)
def test_readme_example():
    proc, checks = run_mode("readme")
    assert proc.returncode == 0, proc.stdout
    assert checks["readme"][0]["results"] == pytest.approx([0.6] * 4), proc.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pickler", PICKLERS)
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
def test_killed_rank_reported_within_seconds_none_left_and_the_next_spawn_works():
    proc, checks = run_mode("kill")
    assert proc.returncode == 0, proc.stdout
    row = checks["kill"][0]
    assert "died without reporting" in row["message"], row
    # Rank 2 alone, or with the ranks the launcher ended right after it (a dying process's
    # connection can end after its victims': then the message names them all).
    named = re.search(r"ranks? \[?([\d, ]+)\]? of 3", row["message"])
    assert named and "2" in named.group(1).split(", "), row
    assert row["rank"] in [int(r) for r in named.group(1).split(", ")], row
    assert row["seconds"] < 15, row
    # Nothing of the job is left below the caller (launcher, proxies, ranks), and no
    # socket of it stays open.
    assert row["workers"] == [] and row["descendants"] == [], row
    assert row["fds_after"] == row["fds_before"], row
    # The same interpreter spawns again; the collectives match numpy.
    assert checks["again"][0]["ok"] is True, proc.stdout
    assert checks["again"][0]["workers"] == [], proc.stdout


@pytest.mark.timeout(120)
def test_keyboard_interrupt_in_the_caller_ends_the_job_and_the_next_spawn_works():
    proc, checks = run_mode("interrupt")
    assert proc.returncode == 0, proc.stdout
    row = checks["interrupt"][0]
    assert row["seconds"] < 15, row
    assert row["alive"] == [] and row["workers"] == [] and row["descendants"] == [], row
    assert row["fds_after"] == row["fds_before"], row
    assert "ended by a KeyboardInterrupt" in checks["rejoin"][0]["message"], proc.stdout
    assert checks["again"][0]["ok"] is True, proc.stdout


@pytest.mark.timeout(120)
def test_a_connection_without_the_token_is_ignored():
    proc, checks = run_mode("intruder")
    assert proc.returncode == 0, proc.stdout
    row = checks["intruder"][0]
    assert row["results"] == [3.0, 3.0], row  # rank 1's own result, not the intruder's
    assert row["workers"] == [], row


@pytest.mark.timeout(120)
def test_timeout_bounds_the_job():
    proc, checks = run_mode("timeout")
    assert proc.returncode == 0, proc.stdout
    row = checks["timeout"][0]
    assert "did not finish within its timeout" in row["message"], row
    assert 3 <= row["seconds"] < 15, row
    assert row["workers"] == [], row
    assert checks["after"][0]["results"] == [1.0, 1.0], proc.stdout


@pytest.mark.slow
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
    assert msgs[6] == ("RuntimeError: spawn: SPMD_MPIEXEC=/nonexistent/mpiexec is not an "
                       "executable file"), msgs
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


@pytest.mark.timeout(120)
def test_a_job_of_one_rank_spawns_a_job_of_its_own():
    from _launch import mpiexec, run
    proc = run(mpiexec(1, sys.executable, PROGRAM, "nested"), timeout=110)
    assert proc.returncode == 0, proc.stdout
    rows = [json.loads(line) for line in proc.stdout.splitlines()
            if line.startswith('{"check": "nested"')]
    assert rows and rows[0]["ok"] is True and rows[0]["workers"] == [], proc.stdout


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_inside_a_slurm_allocation_srun_runs_the_ranks_on_its_nodes():
    """From an salloc of two nodes: srun places the ranks on both, the collectives match
    numpy, a killed rank ends the step on every node (no rank, no step left), and the next
    spawns work.  Open MPI's ranks need srun's PMIx plugin: where this SLURM has none that
    works, spawn says so and how to go on."""
    if reason := slurm_unavailable():
        pytest.skip(reason)
    salloc = ("salloc", "--nodes=2", "--ntasks=4", "--time=4")
    if srun_cannot_start_ranks():
        proc, checks = run_mode("slurm", timeout=240, prefix=salloc)
        assert "srun runs the ranks in this SLURM allocation" in proc.stdout, proc.stdout
        assert f"--mpi={srun_mpi()}" in proc.stdout and "SPMD_MPIEXEC" in proc.stdout, proc.stdout
        return
    # SPMD_SPAWN_HOST names the address the caller listens on: a loopback address of
    # this host that the default choice never takes, so that the ranks reaching it show
    # the setting took effect (the local cluster's nodes are this host).
    host = "127.0.0.2" if _nodes_on_loopback() else socket.gethostname()
    proc, checks = run_mode("slurm", timeout=240, prefix=salloc, SPMD_SPAWN_HOST=host)
    assert proc.returncode == 0, proc.stdout
    row = checks["slurm"][0]
    assert row["ok"] is True, row
    assert row["callers"] == [socket.gethostbyname(host)], row
    assert len(set(row["nodes"])) == 2, row    # both nodes of the allocation
    assert len(row["steps"]) == 1, row    # one job step, all four ranks
    kill = checks["slurm_kill"][0]
    assert "died without reporting" in kill["message"] and kill["seconds"] < 15, kill
    assert kill["spawned"] == [] and kill["steps"] == [] and kill["descendants"] == [], kill
    raised = checks["slurm_raise"][0]
    assert raised["rank"] == 1 and raised["spawned"] == [] and raised["steps"] == [], raised
    again = checks["slurm_again"][0]
    assert again["results"] == [14, 14, 14, 14], again   # 0 + 1 + 4 + 9 on every rank
    assert again["spawned"] == [] and again["steps"] == [], again
