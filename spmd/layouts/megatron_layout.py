"""How initialize_model_parallel lays ranks out: Megatron-LM's RankGenerator order on
DeviceMesh, and the default embedding ranks.  Local arithmetic and mesh calls only."""

from __future__ import annotations

import math

import numpy as np

from spmd.layouts.mesh import DeviceMesh
from spmd.runtime.group import ProcessGroup

__all__ = ["AXES", "axes", "default_embedding_ranks", "default_position_embedding_ranks",
           "embedding_lists", "flat_group", "full_order", "layout_mesh", "positive", "pp_lines"]

AXES = ("tp", "pp", "dp", "ep", "cp")  # Megatron's order of appending missing axes


def positive(value, arg: str, op: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{op}: {arg} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{op}: {arg} must be positive, got {value}")
    return int(value)


def full_order(order, sizes: dict[str, int], op: str) -> list[str]:
    """The axes fastest first: ``order``'s tokens, then size-1 axes it leaves out."""
    if not isinstance(order, str):
        raise TypeError(f"{op}: order must be a str like 'tp-cp-ep-dp-pp', got "
                        f"{type(order).__name__}")
    tokens = order.lower().split("-")
    for t in tokens:
        if t not in AXES:
            raise ValueError(f"{op}: order {order!r} has unknown axis {t!r}; expected axes from "
                             f"{AXES} joined by '-'")
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"{op}: order {order!r} names an axis twice")
    for t in AXES:
        if t not in tokens:
            if sizes[t] != 1:
                raise ValueError(f"{op}: the {t} size is {sizes[t]} but order {order!r} does not "
                                 f"place {t!r}")
            tokens.append(t)
    return tokens


def axes(order: list[str], drop: str) -> list[str]:
    """Mesh dimensions: the order reversed (slowest first), without size-1 axis ``drop``."""
    return [t for t in reversed(order) if t != drop]


def layout_mesh(order: list[str], sizes: dict[str, int], drop: str, names: dict[str, str],
                 timeout, given=None) -> DeviceMesh:
    dims = axes(order, drop)
    full = np.arange(math.prod(sizes[t] for t in dims)).reshape([sizes[t] for t in dims])
    groups = [(given or {}).get(t) for t in dims]
    return DeviceMesh.from_groups("cpu", full, tuple(names.get(t, t) for t in dims), groups,
                                   timeout=timeout)


def flat_group(mesh: DeviceMesh, tokens: list[str], name: str) -> ProcessGroup:
    names = mesh.mesh_dim_names
    assert names is not None  # layout meshes are named
    dims = [n for n in names if n in tokens]  # in mesh order
    return mesh[tuple(dims)].flatten(name).get_group()


def pp_lines(order: list[str], sizes: dict[str, int]) -> list[list[int]]:
    """Every pipeline group's ranks in a layout (computed locally, no groups made)."""
    dims = axes(order, "")
    full = np.arange(math.prod(sizes[t] for t in dims)).reshape([sizes[t] for t in dims])
    d = dims.index("pp")
    return sorted(np.moveaxis(full, d, -1).reshape(-1, full.shape[d]).tolist())




def default_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Megatron's default: the word embeddings live on the first and last stage."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Megatron's default: the position embeddings live on the first stage."""
    return [pp_ranks[0]]


def embedding_lists(pipelines: list[list[int]], rule, arg: str, world_size: int,
                    op: str) -> list[list[int]]:
    """``rule(pipeline ranks)`` for every pipeline, checked: ints, in the world, disjoint.

    Each rank computes every pipeline's list, so every rank refuses alike before any
    group is made.  A rank may hold one embedding group only (one Comm.Split).
    """
    out: list[list[int]] = []
    owner: dict[int, int] = {}
    for i, pipeline in enumerate(pipelines):
        ranks = rule(list(pipeline))
        if not isinstance(ranks, (list, tuple)) or not ranks:
            raise TypeError(f"{op}: {arg}({pipeline}) must return a non-empty list of ranks, "
                            f"got {ranks!r}")
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, (int, np.integer)) \
                    or not 0 <= r < world_size:
                raise ValueError(f"{op}: {arg}({pipeline}) returned {list(ranks)}, expected "
                                 f"global ranks in [0, {world_size})")
            if int(r) in owner:
                raise ValueError(f"{op}: {arg} puts rank {r} in the groups of pipelines "
                                 f"{pipelines[owner[int(r)]]} and {pipeline}; a rank can be in "
                                 "one embedding group only")
            owner[int(r)] = i
        out.append([int(r) for r in ranks])
    return out
