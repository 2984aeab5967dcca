"""Which ranks share a node: MPI's shared-memory split, or pseudo-nodes for testing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from mpi4py import MPI

from spmd.core import settings

__all__ = ["PSEUDO_NODE_ENV", "node_layout", "pseudo_node_size", "split_node"]

PSEUDO_NODE_ENV = "SPMD_PSEUDO_NODE_SIZE"


def pseudo_node_size(environ: Mapping[str, str] | None = None) -> int | None:
    """The pseudo-node size from ``SPMD_PSEUDO_NODE_SIZE``, or None when it is unset.

    Raises:
        ValueError: the variable is set to something other than a positive integer.
    """
    return settings.read(PSEUDO_NODE_ENV, environ)


def split_node(comm: MPI.Intracomm) -> MPI.Intracomm:
    """One new communicator per node, holding the ranks of ``comm`` on that node.

    Every rank of ``comm`` must call it.  Ranks keep their relative order.  With
    ``SPMD_PSEUDO_NODE_SIZE=k``, COMM_WORLD ranks ``i*k .. i*k+k-1`` form pseudo-node
    ``i`` (within a real node).  The caller frees the result.
    """
    host = _host_comm(comm)
    node = _pseudo_split(comm, host)
    if node is not host:
        host.Free()
    return node


# mpi4py's stubs say Split_type and Split return a Comm; on an Intracomm they return an
# Intracomm (and the callers use it as one).

def _host_comm(comm: MPI.Intracomm) -> MPI.Intracomm:
    """The ranks of ``comm`` on this host (the caller frees it)."""
    return cast(MPI.Intracomm, comm.Split_type(MPI.COMM_TYPE_SHARED, comm.Get_rank()))


def _pseudo_split(comm: MPI.Intracomm, host: MPI.Intracomm) -> MPI.Intracomm:
    k = pseudo_node_size()
    if k is None:
        return host
    return cast(MPI.Intracomm, host.Split(MPI.COMM_WORLD.Get_rank() // k, comm.Get_rank()))


def node_layout(comm: MPI.Intracomm) -> tuple[int, int, int]:
    """(rank on the node, ranks on the node, ranks on this host) for ``comm``.

    The node is what :func:`split_node` makes (a pseudo-node under
    ``SPMD_PSEUDO_NODE_SIZE``); the host count is the real one, for telling whether
    ranks outnumber cores.  Every rank of ``comm`` must call it.
    """
    host = _host_comm(comm)
    node = _pseudo_split(comm, host)
    try:
        return node.Get_rank(), node.Get_size(), host.Get_size()
    finally:
        if node is not host:
            node.Free()
        host.Free()
