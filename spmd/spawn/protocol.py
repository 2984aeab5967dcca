"""What spmd.spawn's caller and its started ranks say to each other: the boot script
each rank runs first, and the message tags on their intercommunicator
(:mod:`spmd.spawn.child` describes the protocol).  Constants only, so that the caller
imports them without importing what a rank runs (MPI, the runtime)."""

from __future__ import annotations

__all__ = ["BOOT", "HELLO", "PAYLOAD", "RESULT", "STOP"]

BOOT = """\
import sys
del sys.path[0]  # the private directory this file is in
import json, os, socket, traceback
job = json.load(open(sys.argv[1]))
os.environ.update(job["env"])
sys.path[:0] = job["path"]
os.chdir(job["cwd"])
from mpi4py import MPI
parent = MPI.Comm.Get_parent()
parent.send((MPI.COMM_WORLD.Get_rank(), os.getpid(), socket.gethostname()), dest=0, tag=101)
try:
    from spmd.spawn import child
except BaseException as exc:
    parent.send(("error", type(exc).__qualname__, str(exc), traceback.format_exc()), 0, 103)
    parent.Disconnect()
    raise SystemExit(1)
child.main(job, parent)
"""

# Message tags on the intercommunicator (spmd/spawn/child.py describes the protocol).
HELLO, PAYLOAD, RESULT, STOP = 101, 102, 103, 104
