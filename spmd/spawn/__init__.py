"""Start an SPMD job from plain Python or a notebook: ``spmd.spawn(fn, args, nprocs)``.

The calling process: :mod:`spmd.spawn.parent` (no MPI in it), and the job while it runs:
:mod:`spmd.spawn.job`; the MPI library's launcher it starts: :mod:`spmd.spawn.launcher`;
what each rank runs: :mod:`spmd.spawn.child`; what they say to each other:
:mod:`spmd.spawn.protocol`.
"""

from spmd.spawn.job import (
    ProcessContext,
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
)
from spmd.spawn.parent import spawn

__all__ = ["ProcessContext", "ProcessException", "ProcessExitedException",
           "ProcessRaisedException", "spawn"]
