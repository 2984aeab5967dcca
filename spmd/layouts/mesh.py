"""DeviceMesh: ranks laid out on an n-dimensional grid, with one group per dimension.

Semantics are torch's (``torch.distributed.device_mesh``): ranks are laid out
row-major (last dimension fastest) and the group along a dimension holds the ranks
that differ only in that coordinate.  Every group of one dimension comes from one
``Comm.Split`` of WORLD (``spmd.layouts.mesh_groups``), so building a mesh costs one
split per dimension whatever the number of groups.  Group ranks follow global ranks, as
torch's ``new_group`` does.

Meshes derived from a root mesh (slices, ``_flatten``, ``_unflatten``, ``_concatenate``)
describe each dimension by where its ranks sit in the root's ranks (``_mesh_layout``),
as torch does with its layouts, so they have torch's shapes, coordinates and groups;
derived meshes share the groups of the dimensions they keep.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from spmd.core.typing import Timeout
from spmd.layouts import mesh_layout as lay
from spmd.layouts.mesh_args import (
    check_device_type,
    check_mesh,
    check_names,
    check_overrides,
    check_sizes,
)
from spmd.layouts.mesh_groups import dim_group
from spmd.runtime.group import GroupMember, ProcessGroup, _NonGroupMember, default_group

__all__ = ["DeviceMesh", "MeshDimError", "init_device_mesh", "rebuild_device_mesh"]


class MeshDimError(KeyError, ValueError):
    """An unknown, repeated or out-of-order mesh dimension name.

    A KeyError, as in torch's ``mesh["name"]``, and a ValueError, as for every other
    wrong argument in spmd.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _locate(full: np.ndarray, rank: int) -> tuple[int, ...] | None:
    hit = np.argwhere(full == rank)
    return tuple(int(i) for i in hit[0]) if len(hit) else None


class DeviceMesh:
    """Global ranks laid out on an n-dimensional grid; one ProcessGroup per dimension.

    Every rank of WORLD must create the mesh with the same ``mesh`` (and names), or
    the splits hang or build the wrong groups.  Ranks not in ``mesh`` get a mesh whose
    ``get_coordinate()`` is None and that has no groups.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
        mesh: array-like of distinct global ranks; its shape is the mesh shape.
        mesh_dim_names: one unique name per dimension, for ``mesh["name"]``.
        backend_override: ``{dim index or name: backend name}`` for some dimensions'
            groups; the others use WORLD's backend.
    """

    def __init__(self, device_type: str, mesh: ArrayLike | None = None, *,
                 mesh_dim_names: Sequence[str] | None = None,
                 backend_override: dict[int | str, str] | None = None) -> None:
        op = "DeviceMesh"
        device_type = check_device_type(device_type, op)
        if mesh is None:
            raise TypeError(f"{op}: mesh (an array-like of global ranks) is required")
        world = _default_or_init()
        full = check_mesh(mesh, world.context.size, op)
        names = check_names(mesh_dim_names, full.ndim, op)
        backends = check_overrides(backend_override, full.ndim, names, op)
        self._init_root(device_type, full, names, world.context.rank)
        self._groups = tuple(self._split(self._layout[d], self._label(d), backends[d], None)
                             for d in range(full.ndim))

    # -- construction helpers ----------------------------------------------------

    def _init_root(self, device_type: str, full: np.ndarray, names, rank: int) -> None:
        self._device_type = device_type
        self._full = full
        self._rank_map = full.ravel()
        self._root: DeviceMesh | None = None
        self._layout = lay.row_major(full.shape)  # per dimension: modes over the rank map
        self._names = names
        hit = np.flatnonzero(self._rank_map == rank)
        self._pos = int(hit[0]) if hit.size else None  # this rank's index in the rank map
        self._rank = rank
        self._flat: dict[str, DeviceMesh] = {}
        self._made: list[ProcessGroup] = []  # groups made by unflattening its meshes
        self._timeout: Timeout | None = None  # of groups split later (flattening); WORLD's if None

    @classmethod
    def from_groups(cls, device_type: str, full: np.ndarray, names: tuple[str, ...] | None,
                    groups: list[Any], timeout: Timeout | None = None) -> DeviceMesh:
        """A root mesh whose dimension groups are given (an entry None: split one here,
        with ``timeout``, as later flattened dimensions will be)."""
        mesh = cls.__new__(cls)
        mesh._init_root(device_type, full, names, default_group("DeviceMesh").context.rank)
        mesh._timeout = timeout
        mesh._groups = tuple(g if g is not None else
                             mesh._split(mesh._layout[d], mesh._label(d), None, timeout)
                             for d, g in enumerate(groups))
        return mesh

    def _view(self, layout, names, groups) -> DeviceMesh:
        """A mesh over this mesh's root's rank map; no communication."""
        root = self._root_mesh()
        view = DeviceMesh.__new__(DeviceMesh)
        view._device_type = root._device_type
        view._full = root._full
        view._rank_map = root._rank_map
        view._root = root
        view._layout = tuple(layout)
        view._names = tuple(names)
        view._pos = root._pos
        view._rank = root._rank
        view._flat = {}
        view._groups = tuple(groups)
        return view

    def _root_mesh(self) -> DeviceMesh:
        return self if self._root is None else self._root

    def _split(self, modes: lay.Modes, label: str, backend, timeout) -> Any:
        """This rank's group along a dimension (``modes``) of this root mesh's rank map;
        every rank of WORLD calls it (see ``dim_group``)."""
        return dim_group(self._rank_map.size, self._pos, modes, label, backend, timeout)

    def _get_root_mesh(self) -> DeviceMesh:
        """The mesh this one was sliced, flattened, unflattened or concatenated from.

        A mesh built by the constructor, ``init_device_mesh`` or ``from_group`` is its
        own root.  As in torch, flattened dimensions are remembered by the root.
        """
        return self._root_mesh()

    def _owned_groups(self) -> list[ProcessGroup]:
        """Every group made for this mesh's root and the meshes derived from it, once
        each, without WORLD (what a caller destroys to free them)."""
        root = self._root_mesh()
        seen, out = set(), []
        for g in [*root._groups, *(f._groups[0] for f in root._flat.values()), *root._made]:
            if g is None or g is GroupMember.NON_GROUP_MEMBER or g is GroupMember.WORLD \
                    or id(g) in seen:
                continue
            seen.add(id(g))
            out.append(g)
        return out

    def _label(self, dim: int) -> str:
        return self._names[dim] if self._names else f"dim_{dim}"

    # -- shape -------------------------------------------------------------------

    @property
    def device_type(self) -> str:
        return self._device_type

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return self._names

    @property
    def ndim(self) -> int:
        return len(self._layout)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(lay.size(m) for m in self._layout)

    def size(self, mesh_dim: int | str | None = None) -> int:
        """The number of ranks in the mesh, or along ``mesh_dim``."""
        if mesh_dim is None:
            return math.prod(self.shape)
        return self.shape[self._dim_index(mesh_dim, "size")]

    @property
    def mesh(self) -> np.ndarray:
        """The global ranks of this mesh (for a submesh, the one holding this rank)."""
        grid = np.zeros((), dtype=np.int64)
        for modes in self._layout:
            grid = grid[..., None] + lay.offsets(modes)
        whole = lay.collapse(self._layout)
        copies = self._rank_map.size // lay.size(whole)
        base = 0
        if copies > 1:
            if self._pos is None:
                raise RuntimeError("DeviceMesh.mesh: this rank is not in the mesh, and the "
                                   f"submesh is one of {copies}; there is no single answer")
            base = int(lay.digit_base(self._pos, whole)[1])
        return self._rank_map[base + grid].copy()

    # -- this rank ---------------------------------------------------------------

    def get_rank(self) -> int:
        """This process's global rank."""
        return self._rank

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's index along every dimension, or None if it is not in the mesh."""
        if self._pos is None:
            return None
        return tuple(lay.coordinate(self._pos, modes) for modes in self._layout)

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's rank in the group of ``mesh_dim`` (optional for a 1-D mesh)."""
        return self.get_group(mesh_dim).rank()

    # -- groups ------------------------------------------------------------------

    def _dim_index(self, mesh_dim, op: str) -> int:
        if isinstance(mesh_dim, str):
            if not self._names or mesh_dim not in self._names:
                raise MeshDimError(f"DeviceMesh.{op}: no mesh dimension {mesh_dim!r}; expected "
                                   f"one of mesh_dim_names {self._names}")
            return self._names.index(mesh_dim)
        if isinstance(mesh_dim, bool) or not isinstance(mesh_dim, (int, np.integer)):
            raise TypeError(f"DeviceMesh.{op}: mesh_dim must be an int or a name, got "
                            f"{type(mesh_dim).__name__}")
        if not -self.ndim <= mesh_dim < self.ndim:
            raise ValueError(f"DeviceMesh.{op}: mesh_dim {mesh_dim} is out of range for a "
                             f"{self.ndim}-D mesh")
        return int(mesh_dim) % self.ndim

    def get_group(self, mesh_dim: int | str | None = None) -> ProcessGroup:
        """The group along ``mesh_dim`` (index or name) holding this rank.

        ``mesh_dim`` may be left out for a 1-D mesh.  As in torch, a name of a dimension
        flattened from this mesh's root works on every mesh of that root.

        Raises:
            RuntimeError: ``mesh_dim`` is None on a mesh of several dimensions, or this
                rank is not in the mesh.
        """
        if mesh_dim is None:
            if self.ndim != 1:
                raise RuntimeError(f"DeviceMesh.get_group: the mesh has {self.ndim} dimensions; "
                                   "pass mesh_dim, or use get_all_groups()")
            mesh_dim = 0
        flat = self._root_mesh()._flat.get(mesh_dim) if isinstance(mesh_dim, str) else None
        if flat is not None:  # torch looks there first
            group = flat._groups[0]
        else:
            group = self._groups[self._dim_index(mesh_dim, "get_group")]
        if group is None or group is GroupMember.NON_GROUP_MEMBER:
            raise RuntimeError(f"DeviceMesh.get_group: global rank {self._rank} is not in the mesh "
                               f"{self._full.tolist() if self._full.size <= 64 else self.shape}")
        return group

    def get_all_groups(self) -> list[ProcessGroup]:
        """The groups of every dimension, in dimension order (this rank's ones).

        Raises:
            RuntimeError: this rank is not in the mesh.
        """
        return [self.get_group(d) for d in range(self.ndim)]

    # -- slicing, flattening, unflattening, concatenating ------------------------

    def __getitem__(self, mesh_dim_names: str | tuple[str, ...]) -> DeviceMesh:
        """The submesh over the named dimensions (in mesh order), sharing their groups.

        No communication.  On the root mesh, names of flattened dimensions work too.

        Raises:
            MeshDimError: an unknown or repeated name, or names out of mesh order.
            RuntimeError: the named dimensions overlap (a flattened one and its parts).
        """
        if not self._names:
            raise RuntimeError("DeviceMesh: cannot slice a mesh without mesh_dim_names")
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        if names == self._names:
            return self
        flat = self._root_mesh()._flat if self == self._root_mesh() else {}
        valid = list(self._names) + [n for n in flat if n not in self._names]
        layout, groups = [], []
        for n in names:
            if n in self._names:
                layout.append(self._layout[self._names.index(n)])
                groups.append(self._groups[self._names.index(n)])
            elif n in flat:
                layout.append(flat[n]._layout[0])
                groups.append(flat[n]._groups[0])
            else:
                raise MeshDimError(f"DeviceMesh[{names}]: no mesh dimension {n!r}; expected "
                                   f"names from {valid}")
        if len(set(names)) != len(names):
            raise MeshDimError(f"DeviceMesh[{names}]: a dimension is named twice")
        whole = lay.collapse(layout)
        if not lay.sorted_descending(whole):  # torch's rule: size-1 dimensions go anywhere
            raise MeshDimError(f"DeviceMesh[{names}]: dimensions must be given in mesh order "
                               f"{valid}")
        if not lay.fits(whole, self._rank_map.size):
            raise RuntimeError(f"DeviceMesh[{names}]: the dimensions overlap")
        return self._view(layout, names, groups)

    def flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """A 1-D mesh over all ranks of this (sub)mesh, e.g. ``mesh["dp", "cp"]._flatten()``.

        Every rank of WORLD must call it (one ``Comm.Split``); a second call with the
        same name returns the same mesh.  The root mesh remembers it: ``root["dp_cp"]``
        and ``root.get_group("dp_cp")`` find it.

        Args:
            mesh_dim_name: the new dimension's name; the names joined by "_" if None.
        """
        op = "DeviceMesh._flatten"
        if not self._names:
            raise RuntimeError(f"{op}: cannot flatten a mesh without mesh_dim_names")
        name = mesh_dim_name or "_".join(self._names)
        if not isinstance(name, str):
            raise TypeError(f"{op}: mesh_dim_name must be a str, got {type(name).__name__}")
        if self.ndim == 1 and name in self._names:
            return self
        root = self._root_mesh()
        if root._names and name in root._names:
            raise ValueError(f"{op}: {name!r} is already a dimension of the root mesh "
                             f"{root._names}; choose another name")
        whole = lay.collapse(self._layout)
        known = root._flat.get(name)
        if known is not None:
            if known._layout == (whole,):
                return known
            raise ValueError(f"{op}: a different flattened dimension is already named {name!r}")
        group = root._split(whole, name, None, root._timeout)
        flat = self._view((whole,), (name,), (group,))
        root._flat[name] = flat
        return flat

    def _flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """torch's spelling of :meth:`flatten`."""
        return self.flatten(mesh_dim_name)

    def _unflatten(self, dim: int | str, mesh_sizes, mesh_dim_names,
                   backend_override=None) -> DeviceMesh:
        """This mesh with dimension ``dim`` split row-major into ``mesh_sizes``.

        ``mesh._unflatten("world", (2, 4), ("dp", "tp"))`` on a 1-D mesh of 8 ranks
        gives a (2, 4) mesh.  As in torch, the new dimensions get new groups (one
        ``Comm.Split`` each; a dimension spanning the world is WORLD), the others keep
        this mesh's, and the result has this mesh's root.  Every rank of WORLD must
        call it with the same arguments.

        Args:
            dim: index or name of the dimension to split.
            mesh_sizes: sizes of the new dimensions; their product is ``dim``'s size.
            mesh_dim_names: one new name per new dimension.
            backend_override: ``{new dim index or name: backend name}``.

        Raises:
            ValueError: ``dim`` out of range or unknown, sizes that do not multiply to its
                size or cannot be laid over it, names missing or repeated in the result.
            RuntimeError: the mesh has no mesh_dim_names.
        """
        op = "DeviceMesh._unflatten"
        if not self._names:
            raise RuntimeError(f"{op}: cannot unflatten a mesh without mesh_dim_names")
        if isinstance(dim, str):
            if dim not in self._names:
                raise ValueError(f"{op}: dim {dim!r} is not one of mesh_dim_names {self._names}")
            dim = self._names.index(dim)
        elif isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
            raise TypeError(f"{op}: dim must be an int or a name, got {type(dim).__name__}")
        elif not -self.ndim <= dim < self.ndim:
            raise ValueError(f"{op}: dim {dim} is out of range for a {self.ndim}-D mesh")
        dim = int(dim) % self.ndim
        sizes = check_sizes(mesh_sizes, op)
        if mesh_dim_names is None:
            raise TypeError(f"{op}: mesh_dim_names (one name per new dimension) is required")
        names = check_names(mesh_dim_names, len(sizes), op)
        try:
            parts = lay.compose(self._layout[dim], sizes)
        except ValueError as exc:
            raise ValueError(f"{op}: dimension {self._names[dim]!r} of size {self.shape[dim]}: "
                             f"{exc}") from None
        all_names = self._names[:dim] + names + self._names[dim + 1:]
        check_names(all_names, len(all_names), op)
        backends = check_overrides(backend_override, len(sizes), names, op)
        root = self._root_mesh()
        made = [root._split(m, n, b, root._timeout) for m, n, b in zip(parts, names, backends)]
        root._made.extend(g for g in made if g is not None)
        return self._view(self._layout[:dim] + parts + self._layout[dim + 1:], all_names,
                          self._groups[:dim] + tuple(made) + self._groups[dim + 1:])

    @staticmethod
    def _concatenate(device_mesh_list) -> DeviceMesh:
        """One mesh whose dimensions are those of the given meshes, in order.

        The meshes must come from the same rank map (one root, or roots over the same
        ranks) and their dimensions must not overlap, e.g.
        ``DeviceMesh._concatenate([mesh["dp"], mesh["tp"]])``.  No communication: the
        result shares their groups and has the first mesh's root, as in torch.

        Raises:
            RuntimeError: the meshes come from different rank maps, or overlap.
            ValueError: no meshes, or a dimension name repeated.
        """
        op = "DeviceMesh._concatenate"
        if not isinstance(device_mesh_list, (list, tuple)) or not device_mesh_list:
            raise ValueError(f"{op}: expected a non-empty list of DeviceMesh, got "
                             f"{device_mesh_list!r}")
        for m in device_mesh_list:
            if not isinstance(m, DeviceMesh):
                raise TypeError(f"{op}: expected DeviceMesh entries, got {type(m).__name__}")
            if not m._names:
                raise RuntimeError(f"{op}: cannot concatenate a mesh without mesh_dim_names")
        first = device_mesh_list[0]
        if any(not np.array_equal(m._rank_map, first._rank_map) for m in device_mesh_list):
            raise RuntimeError(f"{op}: cannot concatenate meshes derived from different device "
                               "meshes (their ranks differ)")
        layout = tuple(modes for m in device_mesh_list for modes in m._layout)
        names = tuple(n for m in device_mesh_list for n in m._names)
        check_names(names, len(names), op)
        if not lay.fits(lay.collapse(layout), first._rank_map.size):
            raise RuntimeError(f"{op}: cannot concatenate overlapping meshes "
                               f"{list(device_mesh_list)}")
        return first._view(layout, names, tuple(g for m in device_mesh_list for g in m._groups))

    # -- from existing groups ----------------------------------------------------

    @staticmethod
    def from_group(group: ProcessGroup | Sequence[ProcessGroup], device_type: str,
                   mesh: ArrayLike | None = None, *,
                   mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
        """A mesh over existing groups: one group for a 1-D mesh, or a list with ``mesh``.

        No communication.  For several groups, ``mesh`` and ``mesh_dim_names`` are
        required and group ``i`` must be the one along dimension ``i`` through this rank.

        Raises:
            ValueError: ``mesh`` does not match the groups, or a required argument is missing.
        """
        op = "DeviceMesh.from_group"
        device_type = check_device_type(device_type, op)
        world = default_group(op)
        if isinstance(group, ProcessGroup):
            ranks = group.ranks
            if mesh is not None and np.asarray(mesh).ravel().tolist() != ranks:
                raise ValueError(f"{op}: mesh {np.asarray(mesh).tolist()} does not match the "
                                 f"group's ranks {ranks}")
            full = np.array(ranks, dtype=np.int64)
            names = check_names(mesh_dim_names, 1, op)
            return DeviceMesh.from_groups(device_type, full, names, [group])
        groups = list(group) if isinstance(group, (list, tuple)) else None
        if not groups:
            raise ValueError(f"{op}: expected a ProcessGroup or a non-empty list of them, got "
                             f"{group!r}")
        if mesh is None or mesh_dim_names is None:
            raise ValueError(f"{op}: mesh and mesh_dim_names are required with "
                             f"{len(groups)} groups")
        full = check_mesh(mesh, world.context.size, op)
        if full.ndim != len(groups):
            raise ValueError(f"{op}: mesh has {full.ndim} dimensions, expected one per group "
                             f"({len(groups)})")
        names = check_names(mesh_dim_names, full.ndim, op)
        coord = _locate(full, world.context.rank)
        checked: list[ProcessGroup | _NonGroupMember] = []
        for d, g in enumerate(groups):
            if coord is None:
                checked.append(GroupMember.NON_GROUP_MEMBER)
                continue
            if not isinstance(g, ProcessGroup):
                raise TypeError(f"{op}: group {d} must be a ProcessGroup, got {type(g).__name__}")
            line = full[tuple(slice(None) if a == d else coord[a] for a in range(full.ndim))]
            if sorted(line.tolist()) != sorted(g.ranks):
                raise ValueError(f"{op}: group {d} holds ranks {g.ranks}, but along dimension "
                                 f"{d} the mesh gives {line.tolist()} for rank {world.context.rank}")
            checked.append(g)
        return DeviceMesh.from_groups(device_type, full, names, checked)

    # -- identity ----------------------------------------------------------------

    def _key(self) -> tuple:
        return (self._rank_map.tobytes(), self._layout, self._device_type, self._names)

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, DeviceMesh) and self._key() == other._key())

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        if self._names:
            dims = ", ".join(f"{n}={s}" for n, s in zip(self._names, self.shape))
            return f"DeviceMesh(({dims}), '{self._device_type}')"
        return f"DeviceMesh({self.shape}, '{self._device_type}')"


def _default_or_init() -> ProcessGroup:
    from spmd.runtime.group import world_state

    if world_state.world is None:  # torch's meshes initialise the default group too
        from spmd.runtime.world import init_process_group

        init_process_group()
    world = world_state.world
    assert world is not None  # init_process_group() made it
    return world


def init_device_mesh(device_type: str, mesh_shape: int | Sequence[int], *,
                     mesh_dim_names: Sequence[str] | None = None,
                     backend_override: dict[int | str, str] | None = None) -> DeviceMesh:
    """Lay out all ranks row-major on a grid of shape ``mesh_shape``; build its groups.

    Every rank must call it with the same arguments.  Initialises spmd first if
    needed.  Costs one ``Comm.Split`` per dimension.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
        mesh_shape: sizes of the dimensions; their product must be the world size.
        mesh_dim_names: one unique name per dimension.
        backend_override: ``{dim index or name: backend name}`` for some dimensions.

    Raises:
        ValueError: the shape does not fit the world, or names are missing/repeated.

    Example::

        mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        tp_group = mesh.get_group("tp")      # ranks {0,1,2,3} or {4,5,6,7}
    """
    op = "init_device_mesh"
    device_type = check_device_type(device_type, op)
    if isinstance(mesh_shape, int) and not isinstance(mesh_shape, bool):
        mesh_shape = (mesh_shape,)
    if not isinstance(mesh_shape, (tuple, list)) or not mesh_shape:
        raise TypeError(f"{op}: mesh_shape must be a non-empty tuple of ints, got {mesh_shape!r}")
    for s in mesh_shape:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s <= 0:
            raise ValueError(f"{op}: mesh_shape {tuple(mesh_shape)} must hold positive ints, "
                             f"got {s!r}")
    shape = tuple(int(s) for s in mesh_shape)
    names = check_names(mesh_dim_names, len(shape), op)
    world = _default_or_init()
    if math.prod(shape) != world.context.size:
        raise ValueError(f"{op}: mesh_shape {shape} holds {math.prod(shape)} ranks, expected "
                         f"the world size ({world.context.size})")
    return DeviceMesh(device_type, np.arange(world.context.size).reshape(shape), mesh_dim_names=names,
                      backend_override=backend_override)


def rebuild_device_mesh(mesh: DeviceMesh, dim: int | str = 0) -> DeviceMesh:
    """``mesh`` laid out again on the world as it is now, after ``spmd.shrink_group()`` of
    the default group: every dimension keeps its size and name except ``dim`` (the
    data-parallel one; the first by default), which takes what is left: the world size
    divided by the other dimensions' sizes.  Every rank of the new world calls it.

    Args:
        mesh: the mesh to rebuild (its groups ended with the old world).
        dim: the dimension that shrinks, by index or name.

    Raises:
        ValueError: the other dimensions do not divide the new world size (fewer
            survivors than one slice of the mesh needs), or ``dim`` is unknown.
    """
    op = "rebuild_device_mesh"
    names = mesh.mesh_dim_names
    shape = list(mesh.shape)
    if isinstance(dim, str):
        if names is None or dim not in names:
            raise ValueError(f"{op}: no mesh dimension named {dim!r} (names: {names})")
        index = names.index(dim)
    elif isinstance(dim, int) and not isinstance(dim, bool) and -len(shape) <= dim < len(shape):
        index = dim % len(shape)
    else:
        raise ValueError(f"{op}: dim must name or index one of {len(shape)} dimensions, got "
                         f"{dim!r}")
    world = _default_or_init()
    others = math.prod(shape) // shape[index]
    if world.context.size % others:
        raise ValueError(f"{op}: the other dimensions hold {others} ranks, which does not "
                         f"divide the world size ({world.context.size})")
    shape[index] = world.context.size // others
    return init_device_mesh(mesh.device_type, tuple(shape), mesh_dim_names=names)
