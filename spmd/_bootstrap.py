"""Start-up exchanges: small facts shared once per group, through the store given to
``init_process_group(store=...)`` when there is one, else over the group's MPI
communicator.  Used for the start-up consistency check (and for NCCL unique ids)."""

from __future__ import annotations

import json

__all__ = ["broadcast_value", "gather_values", "check_same_installation"]


def _key(pg, name: str) -> str:
    pg._bootstrap_count = getattr(pg, "_bootstrap_count", 0) + 1
    members = ",".join(map(str, pg._ranks)) if pg._size <= 16 else f"{pg._ranks[0]}+{pg._size}"
    return f"spmd/bootstrap/[{members}]/{pg._bootstrap_count}/{name}"


def broadcast_value(pg, store, name: str, value: bytes | None, root: int = 0) -> bytes:
    """Every member gets group rank ``root``'s ``value`` (bytes)."""
    if store is None:
        return pg._comm.bcast(value, root)
    key = _key(pg, name)
    if pg._rank == root:
        store.set(key, value)
        return value
    return store.get(key)


def gather_values(pg, store, name: str, value: bytes) -> list[bytes] | None:
    """Group rank 0 gets every member's ``value`` in rank order; others get None."""
    if store is None:
        return pg._comm.gather(value, 0)
    key = _key(pg, name)
    store.set(f"{key}/{pg._rank}", value)
    if pg._rank != 0:
        return None
    return [store.get(f"{key}/{r}") for r in range(pg._size)]


def check_same_installation(pg, store, facts: dict) -> None:
    """Raise on every rank when ranks run different spmd/mpi4py/MPI installations (mixed
    virtual environments across nodes, or an mpi4py built for another MPI)."""
    rows = gather_values(pg, store, "installation", json.dumps(facts, sort_keys=True).encode())
    verdict = b""
    if rows is not None:
        first = json.loads(rows[0])
        for r, raw in enumerate(rows):
            other = json.loads(raw)
            if other != first:
                diff = {k: (first.get(k), other.get(k)) for k in first.keys() | other.keys()
                        if first.get(k) != other.get(k)}
                verdict = (f"rank {r} runs a different installation than rank 0: " + ", ".join(
                    f"{k} {a!r} on rank 0 vs {b!r}" for k, (a, b) in sorted(diff.items()))).encode()
                break
    verdict = broadcast_value(pg, store, "installation-verdict", verdict)
    if verdict:
        raise RuntimeError(f"init_process_group: {verdict.decode()}")
