"""After an NCCL op times out (device double), nothing it wrote reaches the program.

tests/programs/nccl_timeout.py: the last rank never joins an all_reduce the others have
already returned from, and they read its output at once (``cp.asnumpy`` on the main
thread; ``.get()``, ``.item()``, a stream and a device synchronize on threads of their
own), with no pause that would let the job end first.  Each size runs the program
several times, the timeout found first by the watchdog, by the rank's own wait, or by a
host op on the group: under the default policy ("abort") the job must end with the
diagnosis and no read may return; under "raise" every read through spmd must raise and
the raw reads must stay blocked until the program destroys the group.
"""

from __future__ import annotations

import re
import sys

import pytest
from _launch import mpiexec, run

PROGRAM = "tests/programs/nccl_timeout.py"
DETECT = ("watchdog", "wait", "next")
READS = ("get", "item", "stream synchronize", "device synchronize")


def nccl_timeout(n: int, *args: str, **env: str):
    return run(mpiexec(n, sys.executable, PROGRAM, *args), timeout=90, **env)


def said(out: str, pattern: str) -> list[str]:
    """The lines the program printed that match ``pattern`` (not the source lines a
    diagnosis quotes)."""
    return re.findall(rf"^\[rank \d+\] {pattern}.*$", out, re.M)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("attempt", range(5))
def test_a_timed_out_nccl_op_ends_the_job_before_any_read_returns(n, attempt):
    """Default policy: the diagnosis, then the job ends while every read still waits (on
    MPICH, MPI_Abort returns before the launcher ends the rank: the rank must not go on).
    No rank prints USED or RETURNED, none finishes."""
    detect = DETECT[attempt % len(DETECT)]
    proc = nccl_timeout(n, "--detect", detect)
    out = proc.stdout
    assert proc.returncode != 0, out
    assert f"rank {n - 1}: last finished all_reduce #1" in out, out   # the missing rank
    assert "its outputs are not results, so the job ends here, with its stream still " \
           "blocked" in out, out
    for r in range(n - 1):
        for kind in READS:
            assert f"[rank {r}] READING {kind}" in out, out   # the reads had started
    if detect == "wait":
        assert "(collective #3 on group gpu, NCCL, group timeout 1 s)" in out, out
    else:
        assert "spmd watchdog: all_reduce #2 on group gpu is still running on the GPU " \
               "(NCCL)" in out, out
        assert "the group's NCCL communicator is held, not aborted: the op's stream stays " \
               "blocked until the process ends" in out, out
    if detect == "next":
        assert "[rank 0] host barrier RAISED" in out, out
        assert "next op RAISED GroupBrokenError" in out, out
    assert not said(out, "USED") and not said(out, r"READ .* RETURNED"), out
    assert not said(out, "nccl_timeout OK"), out


@pytest.mark.timeout(120)
@pytest.mark.same_on_every_mpi   # the device double's NCCL; no rank ends, nothing aborts
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("detect", DETECT)
def test_a_timed_out_nccl_op_raises_on_every_read_through_spmd_when_asked(n, detect):
    """device_timeout="raise": the process stays up; synchronize, wait, is_completed and
    the group's next op raise; the raw reads stay blocked until the program destroys the
    group, and the job ends normally."""
    # The policy from the environment (SPMD_DEVICE_TIMEOUT), as a job script sets it.
    proc = nccl_timeout(n, "--detect", detect, SPMD_DEVICE_TIMEOUT="raise")
    out = proc.stdout
    assert proc.returncode == 0, out
    assert len(said(out, "nccl_timeout OK")) == n, out
    assert "the group's NCCL communicator is held, not aborted: the op's stream stays " \
           "blocked until the group is destroyed" in out, out
    for r in range(n - 1):
        assert f"[rank {r}] synchronize RAISED" in out, out
        for what in ("wait", "is_completed", "next op"):
            assert f"[rank {r}] {what} RAISED GroupBrokenError" in out, out
        assert f"[rank {r}] READS BLOCKED: {len(READS)} of {len(READS)}" in out, out
        for kind in (*READS, "asnumpy"):
            assert f"[rank {r}] READ {kind} RETURNED" in out, out
    returned = said(out, r"READ .* RETURNED")
    assert len(returned) == (n - 1) * (len(READS) + 1), out
    assert all(line.endswith("after the group was given up") for line in returned), out
    assert not said(out, "USED"), out
