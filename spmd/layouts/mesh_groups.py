"""The groups of a mesh dimension: one ``Comm.Split`` of WORLD makes every group along it.

A dimension is given as modes over the root mesh's rank map (``spmd.layouts.mesh_layout``):
its groups are the dimension's copies, each named by its copy's index, which for a root
dimension is the row-major index of the other coordinates.  ``DeviceMesh`` asks here when
it is built, flattened or unflattened; every rank of WORLD takes part in each split.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from spmd.layouts import mesh_layout as lay
from spmd.runtime.group import (
    ProcessGroup,
    backend_name_of,
    default_group,
    register_group,
    split_comm,
    timeout_seconds,
)

__all__: list[str] = []


def dim_group(rank_count: int, pos: int | None, modes: lay.Modes, label: str, backend,
              timeout) -> ProcessGroup | None:
    """This rank's group along a dimension (``modes``) of a rank map of ``rank_count``
    ranks, where this rank is at index ``pos`` (None: not in the mesh); or None.

    Every rank of WORLD must call it: one ``Comm.Split`` (group.py's ``split_comm``, so split
    hooks such as NCCL's run too), except where no message is needed (groups of one
    rank; one group spanning the world, which is WORLD itself, as in torch).
    """
    op = "DeviceMesh"
    world = default_group(op)
    size = lay.size(modes)
    if size == world.context.size and backend is None and timeout is None:
        return world
    # The groups are the copies of the dimension; name each by its copy's index, which
    # for a root dimension is the row-major index of the other coordinates.
    _, bases = lay.digit_base(np.arange(rank_count), modes)
    copies = np.unique(bases)
    color = MPI.UNDEFINED  # ranks outside the mesh take part in the split, in no group
    if pos is not None:
        color = int(np.searchsorted(copies, bases[pos]))
    if size == 1:  # every rank decides alike, from the layout: no message needed
        if pos is None:
            return None
        return register_group(MPI.COMM_SELF.Dup(), [world.context.rank], f"{label}:{color}",
                              timeout_seconds(timeout, op), backend_name_of(backend, op),
                              f"mesh_{label}")
    return split_comm(world, color, world.context.rank, lambda m: f"{label}:{color}", timeout,
                      backend, f"mesh_{label}", op)
