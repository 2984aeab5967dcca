"""How one group's NCCL communicator comes to be: from a unique id group rank 0 makes and
the others receive (over MPI or the group's store, under the group's deadline), or by
``ncclCommSplit`` of its parent's where NCCL and CuPy have it."""

from __future__ import annotations

from spmd.backends.bootstrap import broadcast_value, check_distinct_gpus
from spmd.backends.nccl.uniqueid import host_identity, uid_for_cupy, uid_to_bytes
from spmd.backends.setup import set_up
from spmd.core.context import GroupContext
from spmd.core.errors import DistBackendError, located

__all__ = ["NOCOLOR", "SPLIT_VERSION", "can_split", "from_unique_id"]

SPLIT_VERSION = 21800  # ncclCommSplit
NOCOLOR = -1           # NCCL_SPLIT_NOCOLOR


def can_split(nccl) -> bool:
    """Whether ``ncclCommSplit`` can run: CuPy has it, and both the NCCL CuPy was built
    against (CuPy raises below 2.18) and the one loaded are 2.18 or later."""
    if not hasattr(nccl.NcclCommunicator, "commSplit"):
        return False
    try:
        return min(int(nccl.get_version()), int(nccl.get_build_version())) >= SPLIT_VERSION
    except Exception:  # noqa: BLE001 - no get_build_version: too old to tell
        return False


def from_unique_id(ctx: GroupContext, cp, nccl, op: str, device: int):
    """A new NCCL communicator of the group (collective over it), on ``device``."""
    bus = cp.cuda.Device(device).pci_bus_id
    value = None
    if ctx.rank == 0:
        try:
            value = uid_to_bytes(nccl.get_unique_id())
        except Exception as exc:  # noqa: BLE001 - the others must hear about it too
            value = b"error:" + f"{type(exc).__name__}: {exc}".encode()

    def exchange() -> bytes:   # blocking MPI (or store) calls: under the group's deadline
        check_distinct_gpus(ctx, ctx.store, host_identity(), bus, op)
        return broadcast_value(ctx, ctx.store, "nccl-unique-id", value)

    raw = set_up(ctx, op, "the NCCL communicator", exchange)
    if raw.startswith(b"error:"):
        raise located(DistBackendError, op, f"ncclGetUniqueId failed on group rank 0: "
                      f"{raw[6:].decode()}", ctx)
    try:
        return nccl.NcclCommunicator(ctx.size, uid_for_cupy(raw), ctx.rank)
    except Exception as exc:
        raise located(DistBackendError, op, f"ncclCommInitRank failed: {exc}", ctx) from exc
