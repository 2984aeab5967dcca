"""spmd under torch.distributed's ``"mpi"`` name, for code written for torch's MPI backend.

Scripts that say ``init_process_group("mpi")``, and Hugging Face Accelerate's multi-CPU
mode (it picks "mpi" when ``torch.distributed.is_mpi_available()``), fail on every pip
wheel of torch: the wheels are built without MPI.  With ``SPMD_TORCH_MPI=1``
(spmd.core.settings) spmd answers to that name.

torch's own MPI path is kept whole, so the name behaves as it does on a torch built with
MPI: ``init_process_group("mpi")`` runs no rendezvous (MPI knows the ranks; no
MASTER_ADDR, RANK or store), ignores ``rank``/``world_size`` with torch's warning, and
``get_backend()`` says "mpi".  Only the two things a build without MPI lacks are filled
in: the flag ``is_mpi_available()`` returns, and ``ProcessGroupMPI``, whose one use by
torch (``ProcessGroupMPI.create(ranks)``: in ``_new_process_group_helper`` in torch 2.13,
in the creator of its built-in "mpi" plugin in 2.14) makes spmd's group here.  A torch
built with MPI keeps its own backend (and a warning says the variable is ignored).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from datetime import timedelta
from typing import Any

from spmd.core.settings import TORCH_MPI, torch_mpi_name

__all__ = ["SpmdAsMPI", "answer_to_mpi"]


class SpmdAsMPI:
    """Stands in for torch's ``ProcessGroupMPI``: torch's ``create(ranks)`` makes the
    spmd backend's group of those global ranks (``[]``: the default group), as the spmd
    backend's creator does for ``init_process_group("spmd")``.  Only the group's
    members call it, as with the spmd backend."""

    @staticmethod
    def create(ranks: list[int]):
        # Imported here: the creator needs torch and MPI, which `import torch` must not load.
        import spmd
        from spmd.torch._process_group import create
        from spmd.torch._store import ensure_spmd

        c10d = importlib.import_module("torch.distributed.distributed_c10d")
        # torch passes ProcessGroupMPI only the ranks (its own MPI has no timeout); the
        # timeout given to init_process_group or new_group is in its caller: torch 2.13's
        # _new_process_group_helper (`timeout`), 2.14's _create_mpi_process_group (`opts`).
        caller = sys._getframe(1)
        local = caller.f_locals if caller.f_globals.get("__name__") == c10d.__name__ else {}
        timeout = local.get("timeout", getattr(local.get("opts"), "timeout", None))
        if not isinstance(timeout, timedelta):
            timeout = c10d.default_pg_timeout
        ensure_spmd(timeout)
        ranks = list(ranks)
        me = spmd.get_rank()
        opts = c10d._DistributedBackendOptions()  # what torch hands a backend's creator
        opts.global_ranks_in_group = ranks
        opts.group_rank = ranks.index(me) if ranks else me
        opts.group_size = len(ranks) if ranks else spmd.get_world_size()
        opts.timeout = timeout
        return create(opts, None)


_decided = False  # SPMD_TORCH_MPI is read once: torch and `import spmd.torch` both register


def answer_to_mpi() -> None:
    """Where ``SPMD_TORCH_MPI=1`` and torch has no MPI backend of its own, make torch's
    ``"mpi"`` backend spmd's (the first call decides, later ones do nothing; starts nothing).

    Raises:
        ValueError: SPMD_TORCH_MPI has a value that is neither on nor off.
    """
    global _decided
    if _decided:
        return
    _decided = True
    if not torch_mpi_name():
        return
    c10d: Any = importlib.import_module("torch.distributed.distributed_c10d")
    if getattr(c10d, "ProcessGroupMPI", None) is not None or c10d.is_mpi_available():
        warnings.warn(f"spmd: {TORCH_MPI}=1 is ignored: this torch was built with MPI, and "
                      "its own \"mpi\" backend is kept", stacklevel=3)
        return
    c10d.ProcessGroupMPI = SpmdAsMPI
    c10d._MPI_AVAILABLE = True  # the flag is_mpi_available() returns; no public setter
