"""What the members of a group exchange to create one NCCL communicator: the unique id,
in a form that travels over MPI or a store, and the host identity NCCL hashes (two ranks
of one communicator on one GPU of one host are refused before NCCL hangs on it)."""

from __future__ import annotations

import os
import socket

import numpy as np

__all__ = ["host_identity", "uid_for_cupy", "uid_to_bytes"]


def uid_to_bytes(uid) -> bytes:
    """NCCL's unique id, as ``get_unique_id()`` returned it, in a form that travels.

    CuPy 14 returns bytes; CuPy 13 a tuple of C ``char`` values, signed or unsigned
    with the platform (x86 vs aarch64), which ``NcclCommunicator`` converts back to
    ``char``: the values are kept exactly, never re-signed.
    """
    if isinstance(uid, (bytes, bytearray)):
        return b"bytes:" + bytes(uid)
    return b"tuple:" + np.asarray([int(v) for v in uid], dtype="<i2").tobytes()


def uid_for_cupy(raw: bytes):
    """The id exactly as rank 0's ``get_unique_id()`` returned it (``uid_to_bytes``'s
    inverse), the form its ``NcclCommunicator`` takes."""
    kind, _, data = raw.partition(b":")
    if kind == b"bytes":
        return bytes(data)
    if kind == b"tuple":
        return tuple(int(v) for v in np.frombuffer(data, dtype="<i2"))
    raise ValueError(f"not an NCCL unique id from uid_to_bytes: {raw[:16]!r}...")


def host_identity() -> str:
    """What NCCL hashes to tell hosts apart: NCCL_HOSTID when set, else the host name
    and the boot id."""
    hostid = os.environ.get("NCCL_HOSTID")
    if hostid:
        return f"NCCL_HOSTID={hostid}"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}{':' + boot if boot else ''}"
