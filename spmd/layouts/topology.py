"""Which ranks share a node: node-local and cross-node groups, and a GPU for each rank.

Where ranks sit among nodes, as groups (spmd.backends.mpi.nodes decides which ranks share a node).  MPI says it
(``Split_type(COMM_TYPE_SHARED)``: the ranks that can share memory); for tests on one
machine, ``SPMD_PSEUDO_NODE_SIZE=k`` cuts every node further into pseudo-nodes of
``k`` consecutive ``COMM_WORLD`` ranks, so that multi-node code paths run on a laptop.
A pseudo-node never spans two real nodes, so shared memory still works inside it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from spmd.backends.mpi.nodes import PSEUDO_NODE_ENV, node_layout, pseudo_node_size, split_node
from spmd.core.typing import Timeout
from spmd.runtime.group import (
    GroupArg,
    ProcessGroup,
    backend_name_of,
    register_group,
    resolve,
    split_comm,
    timeout_seconds,
)
from spmd.runtime.world import get_node_local_rank

__all__ = [
    "PSEUDO_NODE_ENV",
    "NodeTopology",
    "bind_device",
    "node_layout",
    "node_topology",
    "pseudo_node_size",
    "split_node",
    "visible_device_count",
]

@dataclass(frozen=True)
class NodeTopology:
    """Where this rank sits among the nodes of a group.

    ``node_group`` holds the ranks on this node; ``cross_node_group`` the ranks with this
    rank's local rank, one per node (ordered by global rank).  Nodes are numbered
    ``0 .. num_nodes-1`` in the order of their lowest rank.
    """

    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int
    node_group: ProcessGroup
    cross_node_group: ProcessGroup

    @property
    def node_ranks(self) -> list[int]:
        """Global ranks on this node, in local-rank order."""
        return self.node_group.ranks


def node_topology(group: GroupArg = None, *, timeout: Timeout | None = None,
                  backend: str | None = None) -> NodeTopology:
    """Split ``group`` (WORLD if None) by node: a node-local and a cross-node group.

    Every rank of ``group`` must call it.  Costs one shared-memory split, one
    ``Comm.Split`` and two small collectives, whatever the number of nodes.
    """
    op = "node_topology"
    parent = resolve(group, op)
    if parent is None:
        raise ValueError(f"{op}: this rank is not a member of group {group!r}")
    seconds = timeout_seconds(timeout, op)
    backend_name = backend_name_of(backend, op)
    node_comm = split_node(parent.context.comm)
    local_rank, local_size = node_comm.Get_rank(), node_comm.Get_size()
    members = [parent.context.ranks[r] for r in node_comm.allgather(parent.context.rank)]
    # Group rank i of every cross-node group with local rank 0 is the i-th node.
    cross = split_comm(parent, local_rank, parent.context.rank, lambda m: f"cross_node:{local_rank}",
                   timeout, backend, "cross_node", op)
    leader = (cross.rank(), cross.size()) if local_rank == 0 else None
    node_rank, num_nodes = node_comm.bcast(leader, root=0)
    node_group = register_group(node_comm, members, f"node:{node_rank}", seconds, backend_name, "node")
    return NodeTopology(local_rank, local_size, node_rank, num_nodes, node_group, cross)


_NVIDIA_PROC = "/proc/driver/nvidia/gpus"


def _physical_gpus() -> int:
    try:
        return len(os.listdir(_NVIDIA_PROC))
    except OSError:
        return 0


def _visible_entries(value: str) -> list[str]:
    # CUDA stops at the first entry it cannot parse; "-1" hides every device.
    out = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        out.append(entry)
    return out


def visible_device_count(environ: Mapping[str, str] | None = None) -> int:
    """How many GPUs this process may use, honouring ``CUDA_VISIBLE_DEVICES``.

    Asks CuPy when it is installed (it applies the variable itself); otherwise counts
    the NVIDIA driver's devices and applies the variable here.  0 when there is no GPU.
    """
    env = os.environ if environ is None else environ
    if environ is None:
        try:
            import cupy

            count = int(cupy.cuda.runtime.getDeviceCount())
        except Exception:  # noqa: BLE001 - no CuPy, or no driver: count below
            count = None
        if count is not None:
            return count
    physical = _physical_gpus()
    mask = env.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return physical
    entries = _visible_entries(mask)
    return min(len(entries), physical) if physical else len(entries)


def bind_device(local_rank: int | None = None, *, device_count: int | None = None,
                set_current: bool = True) -> int | None:
    """Choose this rank's GPU: ``local_rank % device_count``, and make it current.

    Args:
        local_rank: this rank's rank on its node (``spmd.get_node_local_rank()`` if None).
        device_count: GPUs this process can see (``visible_device_count()`` if None).
            Indices count the devices ``CUDA_VISIBLE_DEVICES`` leaves visible.
        set_current: make the device CuPy's current device when CuPy is installed.

    Returns:
        The device index, or None when no GPU is visible.

    Raises:
        ValueError: a negative ``local_rank`` or ``device_count``.
    """
    if local_rank is None:
        local_rank = get_node_local_rank()
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
        raise ValueError(f"bind_device: local_rank must be a non-negative int, got {local_rank!r}")
    count = visible_device_count() if device_count is None else device_count
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"bind_device: device_count must be a non-negative int, got {count!r}")
    if count == 0:
        return None
    index = local_rank % count
    if set_current:
        try:
            import cupy
        except ImportError:
            cupy = None
        if cupy is not None:
            cupy.cuda.Device(index).use()
    return index
