"""spmd as a torch.distributed backend: ``init_process_group("spmd")`` under mpiexec/srun.

torch registers the backend by itself at ``import torch`` (the ``torch.backends``
entry point); ``import spmd.torch`` registers it explicitly, for
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``.  No MASTER_ADDR, RANK or store is needed: MPI
knows the ranks, and rank 0's TCPStore address travels over MPI.
"""

from __future__ import annotations

from _spmd_torch import BACKEND, register
from spmd.torch._process_group import SpmdProcessGroup
from spmd.torch._work import SpmdWork

__all__ = ["BACKEND", "SpmdProcessGroup", "SpmdWork", "register"]

register()
