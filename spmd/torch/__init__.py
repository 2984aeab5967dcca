"""spmd as a torch.distributed backend: ``init_process_group("spmd")`` under mpiexec/srun.

torch registers the backend by itself at ``import torch`` (the ``torch.backends``
entry point); ``import spmd.torch`` registers it explicitly, for
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``.  No MASTER_ADDR, RANK or store is needed: MPI
knows the ranks, and rank 0's TCPStore address travels over MPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch  # noqa: F401 - without torch, the ImportError says what is missing

from spmd.torch._registration import BACKEND, register

if TYPE_CHECKING:
    from spmd.torch._process_group import SpmdProcessGroup
    from spmd.torch._reconfigure import spawn_peers
    from spmd.torch._work import SpmdWork

__all__ = ["BACKEND", "SpmdProcessGroup", "SpmdWork", "register", "spawn_peers"]


def __getattr__(name: str) -> Any:
    # The classes need torch and MPI: loaded when used, so that torch's autoload of the
    # entry point (spmd.torch._registration:register) imports neither.
    if name == "SpmdProcessGroup":
        from spmd.torch._process_group import SpmdProcessGroup
        return SpmdProcessGroup
    if name == "SpmdWork":
        from spmd.torch._work import SpmdWork
        return SpmdWork
    if name == "spawn_peers":   # torch's reconfigure: new processes that join the group
        from spmd.torch._reconfigure import spawn_peers
        return spawn_peers
    raise AttributeError(f"module 'spmd.torch' has no attribute {name!r}")


register()
