"""torch 2.14's reconfigure on the spmd backend, planned (no rank dies): the group rebuilt
on reordered handles, on fewer (a rank leaves), with a process spmd.torch.spawn_peers
started, and with a process started by a launcher of its own that joins through its
handle's MPI port.  Each job runs tests/programs/reconfigure_job.py under a wall-clock
limit; every process of the new group reports its rank, the size torch, spmd and DDP's
reducer (in C++) see, and an all_reduce over the group.

What a dead rank does is Open MPI's (ULFM): test_ulfm_jobs.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _launch import ROOT, clean_env, mpi_vendor, mpiexec, run

torch = pytest.importorskip("torch", reason="torch is not installed")
if not hasattr(torch.distributed.distributed_c10d, "_reconfigure"):
    pytest.skip(f"torch {torch.__version__} has no reconfigure (torch 2.14 added it)",
                allow_module_level=True)

PROGRAM = "tests/programs/reconfigure_job.py"


def results(out: str) -> list[dict]:
    return sorted((json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines()
                   if line.startswith("RESULT ")), key=lambda r: r["rank"])


def job(n: int, way: str) -> tuple[str, list[dict]]:
    proc = run(mpiexec(n, sys.executable, PROGRAM, way), timeout=120)
    assert proc.returncode == 0, proc.stdout
    return proc.stdout, results(proc.stdout)


def check_group(out: str, rs: list[dict], size: int) -> None:
    """One group of ``size``: every process in it once, each seeing the same size (torch,
    spmd, DDP's reducer) and the same all_reduce of the ranks, handles of one world."""
    assert [r["rank"] for r in rs] == list(range(size)), out
    for r in rs:
        assert (r["size"], r["spmd_size"], r["ddp_size"]) == (size, size, size), out
        assert r["ranks_sum"] == size * (size - 1) / 2, out
        assert r["handle"]["r"] == r["rank"] and r["handle"]["n"] == size, out
    assert len({r["handle"]["w"] for r in rs}) == 1, out          # one world, one id
    assert ("p" in rs[0]["handle"]) and not any("p" in r["handle"] for r in rs[1:]), out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [2, 3])
def test_reversed_handles_reverse_the_ranks(n):
    out, rs = job(n, "reorder")
    check_group(out, rs, n)
    assert [r["was"] for r in rs] == list(range(n))[::-1], out


@pytest.mark.timeout(150)
def test_a_set_of_handles_keeps_the_ranks():
    out, rs = job(3, "set")
    check_group(out, rs, 3)
    assert [r["was"] for r in rs] == [0, 1, 2], out


@pytest.mark.timeout(150)
def test_a_rank_left_out_the_others_go_on_without_it():
    out, rs = job(3, "shrink")
    check_group(out, rs, 2)
    assert [r["was"] for r in rs] == [0, 1], out


@pytest.mark.timeout(150)
def test_a_process_spawn_peers_started_joins():
    out, rs = job(2, "spawn")
    check_group(out, rs, 3)
    assert [r["was"] for r in rs] == [0, 1, "spawned"], out


@pytest.mark.timeout(150)
def test_a_process_started_by_its_own_launcher_joins_through_its_port(tmp_path):
    """Two jobs, each of its own mpiexec: the newcomer's handle carries its MPI port;
    the job of 2 connects to it, and the three are one group."""
    if mpi_vendor() == "Open MPI":
        pytest.skip("Open MPI's wheel connects separately started jobs only through a PMIx "
                    "server they share (a DVM): its mpiexec --dvm fails here")
    newcomer = subprocess.Popen(mpiexec(1, sys.executable, PROGRAM, "newcomer", str(tmp_path)),
                                cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        proc = run(mpiexec(2, sys.executable, PROGRAM, "port", str(tmp_path)), timeout=120)
        other, _ = newcomer.communicate(timeout=60)
    finally:
        if newcomer.poll() is None:
            newcomer.kill()
            newcomer.wait()
    out = proc.stdout + other
    assert proc.returncode == 0 and newcomer.returncode == 0, out
    rs = results(out)
    check_group(out, rs, 3)
    assert [r["was"] for r in rs] == [0, 1, "newcomer"], out
