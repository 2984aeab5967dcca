"""Start-up exchanges: small facts shared once per group, through the store given to
``init_process_group(store=...)`` when there is one, else over the group's MPI
communicator.  Used for the start-up consistency check (and for NCCL unique ids)."""

from __future__ import annotations

import hashlib
import json

from mpi4py import MPI

from spmd.core.context import GroupContext
from spmd.core.errors import located

__all__ = ["broadcast_value", "check_distinct_gpus", "check_same_installation", "duplicate_gpus",
           "gather_values"]

_next_seq = 0  # this process's next group-creation sequence number for store keys


def _key(ctx: GroupContext, name: str) -> str:
    """A store key no other group's exchange can use: the members, a sequence number
    the members agree on (over the group's communicator, the first time the group
    needs one: a re-created group, or another with the same members, gets a new
    one), and the group's own count of exchanges."""
    global _next_seq
    seq = ctx.bootstrap_seq
    if seq is None:
        seq = ctx.bootstrap_seq = ctx.comm.allreduce(_next_seq, op=MPI.MAX)
        _next_seq = seq + 1
    ctx.bootstrap_count += 1
    members = ",".join(map(str, ctx.ranks))
    if ctx.size > 16:
        members = f"{ctx.size}:{hashlib.sha1(members.encode()).hexdigest()[:20]}"
    return f"spmd/bootstrap/[{members}]/{seq}/{ctx.bootstrap_count}/{name}"


def broadcast_value(ctx: GroupContext, store, name: str, value: bytes | None, root: int = 0) -> bytes:
    """Every member gets group rank ``root``'s ``value`` (bytes; other ranks may pass
    None).  Through a store, the last member to read it deletes the key."""
    if store is None:
        return ctx.comm.bcast(value, root)
    if ctx.size == 1:
        assert value is not None  # the only rank is the root
        return value
    key = _key(ctx, name)
    if ctx.rank == root:
        assert value is not None, f"{name}: the root rank must give the value"
        store.set(key, value)
        return value
    got = store.get(key)
    if store.add(f"{key}/read", 1) == ctx.size - 1:
        store.delete_key(key)
        store.delete_key(f"{key}/read")
    return got


def gather_values(ctx: GroupContext, store, name: str, value: bytes) -> list[bytes] | None:
    """Group rank 0 gets every member's ``value`` in rank order; others get None.
    Through a store, rank 0 deletes the keys once it has read them."""
    if store is None:
        return ctx.comm.gather(value, 0)
    if ctx.size == 1:
        return [value]
    key = _key(ctx, name)
    store.set(f"{key}/{ctx.rank}", value)
    if ctx.rank != 0:
        return None
    rows = [store.get(f"{key}/{r}") for r in range(ctx.size)]
    for r in range(ctx.size):
        store.delete_key(f"{key}/{r}")
    return rows


def check_same_installation(ctx: GroupContext, store, facts: dict) -> None:
    """Raise on every rank when ranks run different spmd/mpi4py/MPI installations (mixed
    virtual environments across nodes, or an mpi4py built for another MPI)."""
    rows = gather_values(ctx, store, "installation", json.dumps(facts, sort_keys=True).encode())
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
    verdict = broadcast_value(ctx, store, "installation-verdict", verdict)
    if verdict:
        raise RuntimeError(f"init_process_group: {verdict.decode()}")


def duplicate_gpus(rows: list, ranks) -> str:
    """Why NCCL would refuse these ranks ("" when it would not): two of them present the
    same (host identity, PCI bus id), NCCL's "Duplicate GPU detected".

    Args:
        rows: per group rank, (host identity, PCI bus id); the host identity is what
            NCCL hashes: ``NCCL_HOSTID`` when set, else the host name and boot id.
        ranks: the global rank of each group rank, for the message.
    """
    first: dict = {}
    for r, (host, bus) in enumerate(rows):
        seen = first.setdefault((host, bus), r)
        if seen != r:
            return (f"group ranks {seen} and {r} (global ranks {ranks[seen]} and {ranks[r]}) "
                    f"would share one GPU (PCI bus {bus} on host {host!r}), and NCCL refuses two "
                    "ranks of one communicator on one GPU (\"Duplicate GPU detected\"); give "
                    "each rank its own GPU (init_process_group(device_id=...)), or use MPI for "
                    "GPU arrays (backend='cpu:mpi,cuda:mpi'), or set a different NCCL_HOSTID "
                    "per rank (with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) so that they talk "
                    "over sockets")
    return ""


def check_distinct_gpus(ctx: GroupContext, store, host: str, bus_id: str, op: str) -> None:
    """Raise on every rank, before any NCCL call, when two members would give NCCL the
    same GPU (see :func:`duplicate_gpus`); every member must call it.

    Raises:
        RuntimeError: two members share a (host identity, GPU), naming them and the fixes.
    """
    rows = gather_values(ctx, store, "nccl-gpus", json.dumps([host, bus_id]).encode())
    verdict = b""
    if rows is not None:
        verdict = duplicate_gpus([json.loads(r) for r in rows], ctx.ranks).encode()
    verdict = broadcast_value(ctx, store, "nccl-gpus-verdict", verdict)
    if verdict:
        raise located(RuntimeError, op, verdict.decode(), ctx)
