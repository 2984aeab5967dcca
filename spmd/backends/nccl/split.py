"""NCCL communicator splitting: after ``Comm.Split`` of a group, ``ncclCommSplit``."""

from __future__ import annotations

from spmd.backends.nccl.plans import NOCOLOR
from spmd.backends.registry import Backend as BackendName
from spmd.core.errors import DistBackendError, located

__all__ = ["split_communicator"]


def split_communicator(backend, child, color: int, key: int) -> None:
    """After ``Comm.Split`` of a group whose NCCL communicator exists, split that too
    (``ncclCommSplit`` is collective over the parent: every member calls it)."""
    parent = backend.group
    if backend._comm is None or backend._broken:
        return
    if not backend.can_split():
        return
    cp = backend._cp
    nccl_color = color if child is not None and color >= 0 else NOCOLOR
    with cp.cuda.Device(backend._device):
        # Operations still queued on the parent can deadlock the split (CuPy's warning).
        backend._stream.synchronize()
        try:
            new = backend._comm.commSplit(nccl_color, key)
        except Exception as exc:
            raise located(DistBackendError, "split", f"ncclCommSplit failed: {exc}",
                          parent) from exc
    if child is None:
        if new is not None:
            new.destroy()
        return
    if BackendName.device_map(child._backend_name).get("cuda") in ("nccl", "undefined"):
        child._inherited["cuda"] = new
    else:
        new.destroy()
