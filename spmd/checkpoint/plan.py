"""How the leaves of a checkpoint state are named and how the ranks' blocks fit together.

Used by ``spmd.checkpoint``; everything here is local computation on descriptions the
ranks have already exchanged, so every rank reaches the same verdict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from spmd.checkpoint.shard import Shard, is_array

__all__: list[str] = []


class Reject(Exception):
    """A problem found on one rank, raised on every rank once the ranks have compared."""

    def __init__(self, kind: type[Exception], msg: str) -> None:
        super().__init__(msg)
        self.kind, self.msg = kind, msg


def holds_arrays(d: Mapping) -> bool:
    return any(isinstance(v, Shard) or is_array(v)
               or (isinstance(v, Mapping) and holds_arrays(v)) for v in d.values())


def flatten(state: Any, arg: str, entries: Mapping | None = None
             ) -> list[tuple[str, Mapping, str, Any]]:
    """``(name, parent dict, key, leaf)`` for every leaf, names joined with ``.``.

    A nested dict is walked into when it holds arrays or, on load (``entries`` given),
    when the checkpoint has no entry of its name (a template of arrays to come).
    """
    if not isinstance(state, Mapping):
        raise Reject(TypeError, f"{arg} must be a dict, got {type(state).__name__}")
    out: list = []
    seen: dict[str, str] = {}

    def walk(d: Mapping, prefix: str) -> None:
        for key, v in d.items():
            if not isinstance(key, str) or not key or key.startswith(".") or any(
                    c in key for c in "/\\\0"):
                raise Reject(ValueError, f"{arg} key {key!r} under {prefix or 'the top'!r} "
                              "is not usable as a file name: expected a non-empty str without "
                              "'/', '\\' or NUL, not starting with '.'")
            name = prefix + key
            if isinstance(v, Mapping) and (holds_arrays(v) if entries is None
                                           else name not in entries):
                walk(v, name + ".")
                continue
            if name in seen or len(name.encode()) > 240:
                raise Reject(ValueError, f"{arg} entry {name!r} is ambiguous or too long "
                              "(nested keys are joined with '.')")
            seen[name] = name
            out.append((name, d, key, v))

    walk(state, "")
    return sorted(out, key=lambda e: e[0])


def check_bounds(name: str, desc: dict, arg: str) -> None:
    for lo, n, g in zip(desc["start"], desc["shape"], desc["gshape"]):
        if lo < 0 or lo + n > g:
            raise Reject(ValueError, f"{arg}[{name!r}]: block {desc['shape']} at offset "
                          f"{desc['start']} does not fit in global_shape {desc['gshape']}")


def coverage(name: str, blocks: list[tuple[int, tuple, tuple]], gshape: tuple) -> dict:
    """Which rank writes which block of a sharded array; the blocks must tile it.

    Identical blocks (replicas) are written by the lowest rank; any other overlap, or
    a gap, is an error.
    """
    writer: dict[tuple, int] = {}
    for rank, start, shape in blocks:
        if np.prod(shape, dtype=np.int64) > 0:
            writer.setdefault((start, shape), rank)
    total = int(np.prod(gshape, dtype=np.int64))
    if writer and gshape:
        keys = list(writer)
        lo = np.array([k[0] for k in keys], np.int64)
        hi = lo + np.array([k[1] for k in keys], np.int64)
        meet = np.all((lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :]),
                      axis=2)
        np.fill_diagonal(meet, False)
        if meet.any():
            i, j = (int(x) for x in np.argwhere(meet)[0])
            ri, rj = writer[keys[i]], writer[keys[j]]
            raise Reject(ValueError, f"state[{name!r}]: the block of rank {ri} ({keys[i][1]} at "
                          f"{keys[i][0]}) overlaps the block of rank {rj} ({keys[j][1]} at "
                          f"{keys[j][0]}); blocks may only overlap when identical (replicas)")
    covered = sum(int(np.prod(k[1], dtype=np.int64)) for k in writer)
    if covered != total:
        raise Reject(ValueError, f"state[{name!r}]: the blocks of the ranks cover {covered} of "
                      f"the {total} elements of global_shape {gshape}; every element must "
                      "be in one block")
    return {rank: key for key, rank in writer.items()}


def replicated_block(gshape: tuple, rank: int, size: int) -> tuple[tuple, tuple] | None:
    """This rank's share of writing a replicated array: rows split as numpy.array_split."""
    if not gshape:
        return ((), ()) if rank == 0 else None
    base, extra = divmod(gshape[0], size)
    n = base + (rank < extra)
    if n == 0:
        return None
    start = rank * base + min(rank, extra)
    return (start,) + (0,) * (len(gshape) - 1), (n,) + tuple(gshape[1:])
