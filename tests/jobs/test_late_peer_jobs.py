"""A rank arrives late at an op its peer already gave up (tests/programs/late_peer.py):
what each rank's program sees afterwards, on the compiled call path and the Python one.

Each case runs as its own job under a wall-clock limit; every rank must print "CASE ok"
(its own assertions passed) and the job must end by itself: before this was built, the
"recv" case wrote the late message into the cancelled receive's array, "all_reduce"
reported success on the late rank, and "setup" hung the late rank forever.
"""

from __future__ import annotations

import sys

import pytest
from _launch import mpiexec, run

CASES = [("recv", 2, {}), ("recv", 3, {"SPMD_FASTCALL": "0"}),
         ("all_reduce", 2, {}), ("all_reduce", 3, {}), ("all_reduce", 2, {"SPMD_FASTCALL": "0"}),
         ("all_reduce_view", 2, {}),
         ("setup", 2, {}), ("setup", 3, {}),
         ("send", 2, {}), ("send", 2, {"SPMD_FASTCALL": "0"})]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case,n,env", CASES,
                         ids=[f"{c}-n{n}{'-python' if e else ''}" for c, n, e in CASES])
def test_late_peer(case, n, env):
    proc = run(mpiexec(n, sys.executable, "tests/programs/late_peer.py", case), timeout=75,
               **env)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count(f"{case} ok") == n, proc.stdout[-4000:]
    if case == "send" and "MPICH" in _library():   # a rendezvous send there: given up
        assert "send given up" in proc.stdout, proc.stdout[-4000:]


def _library() -> str:
    """The MPI library the jobs run on (mpi4py's vendor, in a process of its own)."""
    return run([sys.executable, "-c", "from mpi4py import MPI; print(MPI.get_vendor()[0])"],
               timeout=60).stdout
