"""A rank dies and the job goes on: Open MPI with ULFM (``mpiexec --with-ft ulfm``).

Each test starts ``tests/programs/ulfm_kill.py`` at 3 and 4 ranks with the last rank
SIGKILLed at one point (inside a collective, between ops, while nobody waits, while the
others wait on a Work, inside a receive from it, an object collective, a barrier, a
large all_reduce on the shared-memory engine, a subgroup's op).  Every survivor must get
ProcessFailedError naming that rank, then the same error at its next op, then shrink the
default group and get numpy's answer from an all_reduce of the new world.

These tests are Open MPI's: the suite's own MPI may be another (tests/run.sh runs this
file again with each Open MPI of OTHER_MPIS).  On other MPIs the module is skipped with
the reason; what a dead rank does there is tested in test_reliability_jobs.py.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest
from _launch import mpiexec_prefix, run

PROGRAM = "tests/programs/ulfm_kill.py"
POINTS = ["collective", "between", "idle", "work", "p2p", "object", "barrier", "shm",
          "subgroup", "shrink_subgroup"]
# MPI's detection (Open MPI: the runtime sees the process end and tells the others) is
# milliseconds; the victim sleeps 0.2 s inside its op first, and the watchdog ticks once
# a second.  The bound leaves room for an oversubscribed, loaded machine.
DETECT_S = {"between": 3.0}   # the survivors sleep 1 s before their next op
DETECT_DEFAULT = 2.0

if not any("--oversubscribe" in a for a in mpiexec_prefix()):   # Open MPI's launcher
    pytest.skip(f"ULFM jobs need Open MPI's mpiexec (--with-ft ulfm); this suite's is "
                f"{mpiexec_prefix()[0]} (tests/run.sh runs them with OTHER_MPIS' Open MPI)",
                allow_module_level=True)


def ulfm_job(n: int, point: str) -> tuple[str, list[dict]]:
    exe, *flags = mpiexec_prefix()
    cmd = [exe, "--with-ft", "ulfm", *flags, "-n", str(n), sys.executable, PROGRAM, point]
    proc = run(cmd, timeout=90)
    out = proc.stdout
    assert proc.returncode == 0, out   # the survivors finish; the job ends cleanly
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines()
               if line.startswith("RESULT ")]
    return out, sorted(results, key=lambda r: r["rank"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("point", POINTS)
def test_survivors_get_the_failure_shrink_and_go_on(point, n):
    out, results = ulfm_job(n, point)
    victim = n - 1
    assert [r["rank"] for r in results] == list(range(n - 1)), out
    for r in results:
        assert r["error"] == "ProcessFailedError", out
        assert r["failed"] == [victim], out
        assert r["then"] == [victim], out      # the group stays failed, the same set
        assert r["detect_s"] < DETECT_S.get(point, DETECT_DEFAULT), out
        assert r["new_size"] == n - 1, out
        assert r["sum_ok"] is True, out         # numpy's answer on the shrunk world
        assert r["gathered"] == list(range(n - 1)), out
    assert sorted(r["new_rank"] for r in results) == list(range(n - 1)), out
    if point == "subgroup":
        for r in results:
            if r["rank"] < n - 2:               # the subgroup without the victim
                assert r["subgroup_sum_ok"] is True, out
                assert r["group"] == "WORLD", out
            else:                               # the victim's neighbour
                assert r["group"] != "WORLD", out
    if point == "shrink_subgroup":              # ranks 1.. shrank their subgroup first
        for r in results[1:]:
            assert r["subgroup_shrunk"] == [list(range(1, n - 1)), True], out
    if point == "idle":                         # the watchdog found it before any op
        assert all(r["known_before_any_op"] == [victim] for r in results), out
    # reported, by the op that met it or by the watchdog
    assert re.search(rf"rank\(s\) \[{victim}\] (of group \S+ )?died", out), out
    assert "DistTimeoutError" not in out and "MPI_ABORT" not in out, out


def example_output(script: str, timeout: float, heals: int = 1) -> str:
    """The output of ``examples/<script>`` on 4 ranks under ULFM (rank 3 is killed)."""
    exe, *flags = mpiexec_prefix()
    proc = run([exe, "--with-ft", "ulfm", *flags, "-n", "4", sys.executable,
                f"examples/{script}"], timeout=timeout)
    _healed_job_ended(proc, heals)
    return proc.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [3, 4])
def test_a_rank_lost_while_the_others_destroy_the_group_lets_them_finish(n):
    """The last rank dies while the others wait for it inside destroy_process_group
    (freeing the shared-memory engine's window, which every rank of the node meets for):
    their teardown ends without an error and the job finishes with status 0."""
    exe, *flags = mpiexec_prefix()
    proc = run([exe, "--with-ft", "ulfm", *flags, "-n", str(n), sys.executable,
                "tests/programs/ulfm_destroy.py"], timeout=90)
    out = proc.stdout
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    results = sorted((json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines()
                      if line.startswith("RESULT ")), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == list(range(n - 1)), out
    assert all(r["destroy_s"] < 10 for r in results), out   # ended by the death, not a timer


@pytest.mark.timeout(120)
def test_the_example_trains_on_after_a_rank_dies():
    out = example_output("fault_tolerant_training.py", 90)
    for r in range(3):
        assert f"[rank {r}/3] step 7: rank(s) [3] died; shrank the world to 3 ranks" in out, out
    assert "[rank 0/3] trained 20 steps on 3 ranks; final parameters equal the one-process " \
           "reference" in out, out


@pytest.mark.timeout(150)
def test_torch_ddp_example_rebuilds_on_the_shrunk_world():
    """DDP over "spmd": a rank dies inside DDP's all-reduce, the survivors' backward
    raises, torch's own dist.shrink_group shrinks the default group, DDP is rebuilt."""
    pytest.importorskip("torch.distributed", reason="torch is not installed with this MPI")
    out = example_output("fault_tolerant_ddp.py", 120)
    for r in range(3):
        assert f"[rank {r}/3] step 7: rank(s) [3] died" in out, out
    assert "[rank 0/3] trained 20 steps on 3 ranks with DDP; final weights equal the " \
           "one-process reference" in out, out


# -- a hung rank becomes a failed rank ------------------------------------------------

HANG_TIMEOUT = 3.0   # the group timeout hang_one_rank.py sets
HANG_SLACK = 2.0     # the bound past the timeout: query, end, MPI's report, agree


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("how", ["stop", "loop"])
def test_a_hung_rank_is_ended_and_the_survivors_go_on(how, n):
    """The last rank stops (SIGSTOP) or loops forever while the others wait in an
    all_reduce: the survivors end it, every one of them gets ProcessFailedError naming
    it within the timeout plus 2 s, shrinks WORLD and reduces right on it."""
    exe, *flags = mpiexec_prefix()
    cmd = [exe, "--with-ft", "ulfm", *flags, "-n", str(n), sys.executable,
           "tests/programs/hang_one_rank.py", how, str(HANG_TIMEOUT)]
    proc = run(cmd, timeout=90)
    out = proc.stdout
    assert proc.returncode == 0, out
    results = sorted((json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines()
                      if line.startswith("RESULT ")), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == list(range(n - 1)), out
    for r in results:
        assert r["error"] == "ProcessFailedError" and r["failed"] == [n - 1], out
        assert HANG_TIMEOUT <= r["seconds"] < HANG_TIMEOUT + HANG_SLACK, out
        assert r["shrunk_size"] == n - 1 and r["after"] is True, out
    assert f"the hung rank(s) [{n - 1}] are ended so that MPI reports them failed" in out, out


# -- healing: back to full size, with the state --------------------------------------

def _healed_job_ended(proc, heals: int) -> None:
    """A healed job ends with status 0, after any number of heals: the processes heal()
    starts are a job Open MPI's launcher lets fail (spmd.backends.mpi.recoverable_spawn)."""
    del heals
    assert proc.returncode == 0, proc.stdout


@pytest.mark.timeout(200)
@pytest.mark.parametrize("faults", ["kill", "kill,stop"])
def test_the_job_heals_back_to_full_size(faults):
    """Ranks are lost one after another (a kill, then a hang): each time the survivors
    shrink, heal() starts a process for the lost rank, heal_state() hands it the state,
    and the step is redone on 4 ranks; the result equals the fault-free one and the job
    ends cleanly (rc 0)."""
    exe, *flags = mpiexec_prefix()
    cmd = [exe, "--with-ft", "ulfm", *flags, "-n", "4", sys.executable,
           "tests/programs/heal_job.py", faults]
    proc = run(cmd, timeout=180)
    out = proc.stdout
    n_faults = len(faults.split(","))
    _healed_job_ended(proc, n_faults)
    results = sorted((json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines()
                      if line.startswith("RESULT ")), key=lambda r: r["rank"])
    steps = 3 + 4 * n_faults + 2
    assert [r["rank"] for r in results] == [0, 1, 2, 3], out
    lost = [3 - k for k in range(n_faults)]
    for r in results:
        assert r["size"] == 4 and r["step"] == steps, out
        assert r["w"] == [steps * (steps + 1) / 2] * 4, out     # the fault-free sum
        assert [h["failed"] for h in r["heals"]] == [[x] for x in lost], out
        assert [h["new"] for h in r["heals"]] == [[x] for x in lost], out
        assert r["heals"] == results[0]["heals"], out           # one state, from a peer
        me = r["rank"]   # the layout from before: a 2 x 2 mesh on ranks 0-3
        assert r["mesh"] == {"dp": [me % 2, me % 2 + 2], "tp": [2 * (me // 2), 2 * (me // 2) + 1]}, out
    # The last heal's new process is a replacement; the first one's took part since.
    assert results[lost[-1]]["replacement"] is True, out
    assert sum(r["replacement"] for r in results) == 1, out


@pytest.mark.timeout(150)
def test_the_self_healing_example_heals_a_kill_and_a_hang():
    out = example_output("self_healing_training.py", 120, heals=2)
    assert "[rank 3/4] a new process took rank 3 at step 5" in out, out
    assert "[rank 1/4] a new process took rank 1 at step 15" in out, out
    assert re.search(r"\[rank 0/4\] step 5: rank\(s\) \[3\] lost; .* back at full size", out), out
    assert re.search(r"\[rank 0/4\] step 15: rank\(s\) \[1\] lost; .* back at full size", out), out
    assert "[rank 0/4] trained 24 steps on 4 ranks, 2 failure(s) healed; final parameters " \
           "equal the one-process reference" in out, out


# -- torch: reconfigure after a failure, and DDP that heals ---------------------------

def _torch_reconfigure_or_skip() -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed with this MPI")
    if not hasattr(torch.distributed.distributed_c10d, "_reconfigure"):
        pytest.skip(f"torch {torch.__version__} has no reconfigure (torch 2.14 added it)")


@pytest.mark.timeout(150)
def test_torch_reconfigure_shrinks_past_a_dead_rank_and_grows_back():
    """torch 2.14's API on "spmd": the last of 3 ranks is killed inside an all_reduce;
    the survivors catch torch's DistBackendError (spmd's ProcessFailedError), reconfigure
    on their handles (2 ranks), spmd.torch.spawn_peers starts a process, and a
    reconfigure on all handles puts it at the lost rank: 3 ranks, DDP's reducer (C++)
    sees 3."""
    _torch_reconfigure_or_skip()
    exe, *flags = mpiexec_prefix()
    cmd = [exe, "--with-ft", "ulfm", *flags, "-n", "3", sys.executable,
           "tests/programs/reconfigure_job.py", "kill"]
    proc = run(cmd, timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, out
    results = sorted((json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines()
                      if line.startswith("RESULT ")), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1, 2], out
    assert [r["was"] for r in results] == [0, 1, "spawned"], out
    for r in results:
        assert (r["size"], r["spmd_size"], r["ddp_size"], r["ranks_sum"]) == (3, 3, 3, 3.0), out
        assert r["handle"]["r"] == r["rank"] and r["handle"]["n"] == 3, out
    for r in results[:2]:
        assert r["error"] == ["ProcessFailedError", True, [2]], out   # a DistBackendError
        assert r["shrunk_size"] == 2, out
    assert len({r["handle"]["w"] for r in results}) == 1, out


def _self_healing_ddp(heal: str, args: list[str], timeout: float):
    """examples/self_healing_ddp.py on 4 ranks under ULFM, healing by ``heal``."""
    if heal == "reconfigure":
        _torch_reconfigure_or_skip()
    else:
        pytest.importorskip("torch", reason="torch is not installed with this MPI")
    exe, *flags = mpiexec_prefix()
    return run([exe, "--with-ft", "ulfm", *flags, "-n", "4", sys.executable,
                "examples/self_healing_ddp.py", "--heal", heal, *args], timeout=timeout)


# -- healing under faults that hit replacements, rank 0, and the recovery itself --------

SOAK = "benchmarks/heal_soak.py"


def soak(*args: str, timeout: float = 240) -> str:
    """One run of the soak's job (4 ranks, Open MPI's launcher): what the driver printed;
    the run must have healed every fault with exact state and launcher status 0."""
    proc = run([sys.executable, SOAK, "--runs", "1", *args], timeout=timeout,
               SPMD_MPIEXEC=mpiexec_prefix()[0])
    out = proc.stdout
    assert proc.returncode == 0, out
    assert re.search(r"^1 of 1 runs healed every fault with exact state and exit status 0$",
                     out, re.M), out
    return out


@pytest.mark.timeout(150)
def test_a_replacement_is_never_reported_dead():
    """Ranks 0 and 2 die at once (their new processes are one job), then the new rank 2,
    then the new rank 0: every survivor agrees on exactly the process that died, each
    heal restores 4 ranks with exact state, and the launcher returns 0 after 3 heals."""
    out = soak("--script", "kill:0,2@100;kill:2@300/3;kill:0@500/1")
    assert re.search(r"^run 1/1 seed \d+: healed 3 heal\(s\) of 3 fault\(s\), 700 steps "
                     r"exact, launcher 0", out, re.M), out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("where", ["in_shrink:1", "after_shrink:1", "in_heal:0", "before_state:2",
                                   "new_before_join:0"])
def test_a_fault_inside_the_recovery_is_survived(where):
    """Rank 3 dies; inside the recovery another rank dies (inside shrink_group as the
    shrunk world starts, after shrink_group, while heal() runs, before heal_state, or the
    new process before it joins): the recovery starts
    again with whoever is left and ends at full size, and a later fault heals too."""
    out = soak("--script", f"kill:3@100+{where};kill:1@300", "--events")
    assert f'"where": "{where.split(":")[0]}"' in out, out   # the second fault struck
    assert re.search(r"^run 1/1 seed \d+: healed 2 heal\(s\) of 2 fault\(s\), 500 steps "
                     r"exact, launcher 0", out, re.M), out


@pytest.mark.timeout(150)
def test_a_hang_inside_the_recovery_is_survived():
    """Rank 3 hangs; while the survivors heal, rank 1 hangs too (as heal begins); later
    rank 0 hangs and rank 1 of the shrunk world hangs before heal_state: each hang inside
    a recovery is found by the group timeout in heal's own exchanges, ended, and the
    recovery starts again; every run ends at full size with exact state."""
    out = soak("--script", "stop:3@100+in_heal:1;stop:0@300+before_state:1")
    assert re.search(r"^run 1/1 seed \d+: healed 2 heal\(s\) of 2 fault\(s\), 500 steps "
                     r"exact, launcher 0", out, re.M), out


@pytest.mark.timeout(150)
def test_a_hang_inside_shrink_group_is_survived():
    """Rank 3 hangs; rank 1 then stops inside shrink_group, in the shrunk world's first
    exchange, before any control channel runs: the survivors' timeout finds it stopped on
    their node, ends it, and the recovery starts again; a later kill heals too."""
    out = soak("--script", "stop:3@100+in_shrink:1;kill:1@300", "--events")
    assert '"where": "in_shrink"' in out, out
    # The survivor whose timeout finds rank 1 stopped kills it, then waits for MPI to
    # report the death; where another survivor's MPI reports it first, that report is
    # what every survivor raises (the recovery starts again on it) and the finder's
    # diagnosis, overtaken, is not printed.  Either way rank 1's process was ended by a
    # survivor (a stopped process never dies by itself) and the recovery started again.
    assert ("stopped on this node: rank(s) [1]" in out or
            re.search(r"^RETRY ProcessFailedError: shrink_group: rank\(s\) \[1\] of group "
                      r"WORLD failed", out, re.M)), out
    assert re.search(r"^run 1/1 seed \d+: healed 2 heal\(s\) of 2 fault\(s\), 500 steps "
                     r"exact, launcher 0", out, re.M), out


@pytest.mark.timeout(200)
def test_a_whole_node_lost_is_healed():
    """Two pretend nodes of 2 ranks: both ranks of the second node die at once; heal
    restores both, and the shared-memory engine (the 256 KiB all_reduce) and the pair
    groups (one per node) reduce right afterwards; then the same for the first node."""
    proc = run([sys.executable, SOAK, "--runs", "1", "--script", "kill:2,3@100;kill:0,1@300"],
               timeout=180, SPMD_MPIEXEC=mpiexec_prefix()[0], SPMD_PSEUDO_NODE_SIZE="2",
               SPMD_SHM="force")
    assert proc.returncode == 0, proc.stdout
    assert "healed 2 heal(s) of 2 fault(s), 500 steps exact, launcher 0" in proc.stdout, \
        proc.stdout


@pytest.mark.timeout(400)
def test_a_short_seeded_soak_heals_every_fault():
    """A run of 6 seeded random faults (kills and hangs, any rank, rank 0 and earlier
    replacements included, some inside a recovery): every one heals with exact state and
    launcher status 0."""
    proc = run([sys.executable, SOAK, "--runs", "1", "--faults", "6", "--seed", "7",
                "--recovery"], timeout=380, SPMD_MPIEXEC=mpiexec_prefix()[0])
    assert proc.returncode == 0, proc.stdout
    assert "1 of 1 runs healed every fault with exact state and exit status 0" in proc.stdout, \
        proc.stdout


ABORT_BOUND = 5.0   # seconds from the error to the launcher's return


def _leftovers(tag: str) -> list[str]:
    """Processes still running the program with this case (none may outlive the job)."""
    out = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "heal_abort.py" in cmd and tag in cmd:
            out.append(f"{pid}: {cmd}")
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["stopped", "after_heal", "failed_heal"])
def test_an_abort_under_ulfm_ends_the_job(case):
    """An uncaught error under ULFM: with a stopped rank, in a process a heal started, or
    when heal() cannot start anyone: every process is gone and the launcher returned
    non-zero within 5 s of the error (heal's own give-up: its tries, then 5 s)."""
    exe, *flags = mpiexec_prefix()
    proc = run([exe, "--with-ft", "ulfm", *flags, "-n", "4", sys.executable,
                "tests/programs/heal_abort.py", case], timeout=90)
    ended = time.time()
    out = proc.stdout
    raised = [json.loads(line.split("RAISE ", 1)[1]) for line in out.splitlines()
              if line.startswith("RAISE ")]
    assert proc.returncode != 0 and raised, out
    bound = ABORT_BOUND + (3 * 1.0 + 3 * 2.0 if case == "failed_heal" else 0.0)
    assert ended - min(r["t"] for r in raised) < bound, out
    assert not _leftovers(case), (_leftovers(case), out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("heal", ["reconfigure", "spmd"])
def test_the_self_healing_ddp_example_heals_random_faults(heal):
    """examples/self_healing_ddp.py (DDP over "spmd", each lost rank taken by a new
    process with the state from a live peer) with 4 seeded random faults (seed 3: rank 0 killed,
    rank 3 killed, rank 0 hung, rank 1 killed): through torch 2.14's reconfigure (rank
    0's death takes the rendezvous store with it: the next default group gets a new one)
    and through the torch 2.13 path (spmd.heal and a new default group); the weights
    equal the one-process reference."""
    proc = _self_healing_ddp(heal, ["--random", "4", "--seed", "3"], timeout=280)
    out = proc.stdout
    assert proc.returncode == 0, out
    assert "[rank 0/4] a new process took rank 0 at step 15" in out, out   # joined later
    for step, lost in ((6, 0), (9, 3), (15, 0), (18, 1)):
        assert re.search(rf"\[rank 0/4\] step {step}: rank\(s\) \[{lost}\] lost; detected in "
                         r"[\d.]+ s, shrunk in \d+ ms, new process\(es\) started in [\d.]+ s, "
                         r"grown back to 4 in \d+ ms, state \(\d+ B\) handed over in \d+ ms",
                         out), out
    assert f"[rank 0/4] trained 22 steps on 4 ranks with DDP, 4 failure(s) healed (by {heal}); " \
           "final weights equal the one-process reference" in out, out


@pytest.mark.timeout(150)
def test_a_survivor_lost_inside_heals_accept_ends_the_job():
    """The one window Open MPI's accept cannot survive (docs/reliability.md): rank 2 of
    the shrunk world dies while the survivors accept the new process.  The job must end,
    with the diagnosis, within seconds: never a hang."""
    proc = run([sys.executable, SOAK, "--runs", "1", "--script",
                "kill:3@100+during_heal:2;kill:1@300", "--limit", "100"], timeout=140,
               SPMD_MPIEXEC=mpiexec_prefix()[0])
    out = proc.stdout
    assert re.search(r"^run 1/1 seed \d+: FAILED .*launcher 1, ([\d.]+) s$", out, re.M), out
    assert "died while the survivors accepted the 1 process(es) started for ranks [3]" in out, out
    seconds = float(re.search(r"launcher 1, ([\d.]+) s$", out, re.M).group(1))
    assert seconds < 60, out
