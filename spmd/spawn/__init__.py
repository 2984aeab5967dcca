"""Start an SPMD job from plain Python or a notebook: ``spmd.spawn(fn, args, nprocs)``.

The calling process: :mod:`spmd.spawn.parent`; what each started rank runs:
:mod:`spmd.spawn.child`.
"""

from spmd.spawn.parent import (
    ProcessContext,
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    spawn,
)

__all__ = ["ProcessContext", "ProcessException", "ProcessExitedException",
           "ProcessRaisedException", "spawn"]
