"""Argument checks of DeviceMesh and init_device_mesh: every one raises before any
communication, with the same message on every rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import numpy as np

from spmd.runtime.group import backend_name_of

__all__ = ["DEVICES", "check_device_type", "check_mesh", "check_names", "check_overrides",
           "check_sizes"]

DEVICES = ("cpu", "cuda")


def check_device_type(device_type, op: str) -> str:
    if not isinstance(device_type, str):
        raise TypeError(f"{op}: device_type must be a str, got {type(device_type).__name__}")
    if device_type not in DEVICES:
        hint = (" (without a device index: choose the device with spmd.layouts.topology.bind_device)"
                if device_type.split(":")[0] in DEVICES else "")
        raise ValueError(f"{op}: device_type must be one of {DEVICES}, got {device_type!r}{hint}")
    return device_type


@overload
def check_names(names: None, ndim: int, op: str) -> None: ...


@overload
def check_names(names: Sequence[str], ndim: int, op: str) -> tuple[str, ...]: ...


def check_names(names, ndim: int, op: str) -> tuple[str, ...] | None:
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, (tuple, list)):
        raise TypeError(f"{op}: mesh_dim_names must be a tuple of str, got {names!r}")
    names = tuple(names)
    for n in names:
        if not isinstance(n, str) or not n:
            raise TypeError(f"{op}: mesh_dim_names must hold non-empty str, got {n!r} in {names}")
    if len(names) != ndim:
        raise ValueError(f"{op}: mesh_dim_names {names} has {len(names)} names, expected one "
                         f"per mesh dimension ({ndim})")
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"{op}: mesh_dim_names {names} repeats {repeated}; names must be unique")
    return names


def check_overrides(overrides, ndim: int, names, op: str) -> list[str | None]:
    """backend_override ({dim index or name: backend name}) as one entry per dimension."""
    out: list[str | None] = [None] * ndim
    if overrides is None:
        return out
    if not isinstance(overrides, dict):
        raise TypeError(f"{op}: backend_override must be a dict, got {type(overrides).__name__}")
    for key, value in overrides.items():
        if isinstance(key, str) and names and key in names:
            dim = names.index(key)
        elif isinstance(key, int) and not isinstance(key, bool) and 0 <= key < ndim:
            dim = key
        else:
            raise ValueError(f"{op}: backend_override key {key!r} is neither a dimension index "
                             f"in [0, {ndim}) nor one of mesh_dim_names {names}")
        if out[dim] is not None:
            raise ValueError(f"{op}: backend_override names dimension {dim} twice")
        if not isinstance(value, str):
            raise TypeError(f"{op}: backend_override[{key!r}] must be a backend name (str), got "
                            f"{type(value).__name__}")
        out[dim] = backend_name_of(value, op)
    return out


def check_mesh(mesh, world_size: int, op: str) -> np.ndarray:
    try:
        full = np.array(mesh)
    except Exception as exc:
        raise TypeError(f"{op}: mesh must be an array-like of ints, got {type(mesh).__name__}") \
            from exc
    if full.dtype == object or (full.size and full.dtype.kind not in "iu"):
        raise TypeError(f"{op}: mesh must hold ints (global ranks), got dtype {full.dtype}")
    if full.ndim == 0 or full.size == 0:
        raise ValueError(f"{op}: mesh must have at least one dimension and one rank, got "
                         f"shape {full.shape}")
    full = full.astype(np.int64)
    bad = full[(full < 0) | (full >= world_size)]
    if bad.size:
        raise ValueError(f"{op}: mesh holds rank {int(bad[0])}, expected ranks in "
                         f"[0, {world_size}) (the world size is {world_size})")
    if np.unique(full).size != full.size:
        values, counts = np.unique(full, return_counts=True)
        raise ValueError(f"{op}: mesh lists rank {int(values[counts > 1][0])} more than once")
    return full


def check_sizes(sizes, op: str) -> tuple[int, ...]:
    if not isinstance(sizes, (tuple, list)) or not sizes:
        raise TypeError(f"{op}: mesh_sizes must be a non-empty tuple of ints, got {sizes!r}")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s <= 0:
            raise ValueError(f"{op}: mesh_sizes {tuple(sizes)} must hold positive ints, got {s!r}")
    return tuple(int(s) for s in sizes)
