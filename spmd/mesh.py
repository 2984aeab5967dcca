"""DeviceMesh: ranks laid out on an n-dimensional grid, with one group per dimension.

Semantics are torch's (``torch.distributed.device_mesh``): ranks are laid out
row-major (last dimension fastest) and the group along a dimension holds the ranks
that differ only in that coordinate.  Every group of one dimension comes from one
``Comm.Split`` of WORLD, so building a mesh costs one split per dimension whatever
the number of groups.  Group ranks follow global ranks, as torch's ``new_group`` does.
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from .group import (
    GroupMember,
    ProcessGroup,
    _backend_name,
    _register,
    _split,
    _timeout_seconds,
    default_group,
)

__all__ = ["DeviceMesh", "MeshDimError", "init_device_mesh"]

_DEVICES = ("cpu", "cuda")


class MeshDimError(KeyError, ValueError):
    """An unknown, repeated or out-of-order mesh dimension name.

    A KeyError, as in torch's ``mesh["name"]``, and a ValueError, as for every other
    wrong argument in spmd.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _check_device_type(device_type, op: str) -> str:
    if not isinstance(device_type, str):
        raise TypeError(f"{op}: device_type must be a str, got {type(device_type).__name__}")
    if device_type not in _DEVICES:
        hint = (" (without a device index: choose the device with spmd.topology.bind_device)"
                if device_type.split(":")[0] in _DEVICES else "")
        raise ValueError(f"{op}: device_type must be one of {_DEVICES}, got {device_type!r}{hint}")
    return device_type


def _check_names(names, ndim: int, op: str) -> tuple[str, ...] | None:
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


def _check_overrides(overrides, ndim: int, names, op: str) -> list[str | None]:
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
        out[dim] = _backend_name(value, op)
    return out


def _check_mesh(mesh, world_size: int, op: str) -> np.ndarray:
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


def _locate(full: np.ndarray, rank: int) -> tuple[int, ...] | None:
    hit = np.argwhere(full == rank)
    return tuple(int(i) for i in hit[0]) if len(hit) else None


def _dim_group(root: DeviceMesh, axes: tuple[int, ...], label: str, backend, timeout):
    """This rank's group along root axes ``axes`` (flattened row-major), or None.

    Every rank of WORLD must call it: one ``Comm.Split`` (group.py's ``_split``, so split
    hooks such as NCCL's run too), except where no message is needed (groups of one
    rank; one group spanning the world, which is WORLD itself).
    """
    op = "DeviceMesh"
    world = default_group(op)
    full, coord = root._full, root._coord
    size = math.prod(full.shape[a] for a in axes)
    if size == world._size and backend is None and timeout is None:
        return world
    others = [a for a in range(full.ndim) if a not in axes]
    color = MPI.UNDEFINED  # ranks outside the mesh take part in the split, in no group
    if coord is not None:
        color = int(np.ravel_multi_index([coord[a] for a in others],
                                         [full.shape[a] for a in others])) if others else 0
    if size == 1:  # every rank decides alike, from the shape: no message needed
        if coord is None:
            return None
        return _register(MPI.COMM_SELF.Dup(), [world._rank], f"{label}:{color}",
                         _timeout_seconds(timeout, op), _backend_name(backend, op),
                         f"mesh_{label}")
    return _split(world, color, world._rank, lambda m: f"{label}:{color}", timeout, backend,
                  f"mesh_{label}", op)


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

    def __init__(self, device_type: str, mesh=None, *, mesh_dim_names=None,
                 backend_override=None) -> None:
        op = "DeviceMesh"
        device_type = _check_device_type(device_type, op)
        if mesh is None:
            raise TypeError(f"{op}: mesh (an array-like of global ranks) is required")
        world = _default_or_init()
        full = _check_mesh(mesh, world._size, op)
        names = _check_names(mesh_dim_names, full.ndim, op)
        backends = _check_overrides(backend_override, full.ndim, names, op)
        self._init_root(device_type, full, names, world._rank)
        self._groups = tuple(_dim_group(self, (d,), self._label(d), backends[d], None)
                             for d in range(full.ndim))

    # -- construction helpers ----------------------------------------------------

    def _init_root(self, device_type: str, full: np.ndarray, names, rank: int) -> None:
        self._device_type = device_type
        self._full = full
        self._root = None
        self._axes = tuple((d,) for d in range(full.ndim))
        self._names = names
        self._coord = _locate(full, rank)
        self._rank = rank
        self._flat: dict[str, DeviceMesh] = {}
        self._timeout = None  # of groups split later (flattening); WORLD's if None

    @classmethod
    def _with_groups(cls, device_type: str, full: np.ndarray, names, groups,
                     timeout=None) -> DeviceMesh:
        """A root mesh whose dimension groups are given (an entry None: split one here,
        with ``timeout``, as later flattened dimensions will be)."""
        mesh = cls.__new__(cls)
        mesh._init_root(device_type, full, names, default_group("DeviceMesh")._rank)
        mesh._timeout = timeout
        mesh._groups = tuple(g if g is not None else
                             _dim_group(mesh, (d,), mesh._label(d), None, timeout)
                             for d, g in enumerate(groups))
        return mesh

    def _view(self, axes, names, groups) -> DeviceMesh:
        """A mesh over some (possibly merged) axes of this mesh's root; no communication."""
        root = self._root_mesh()
        view = DeviceMesh.__new__(DeviceMesh)
        view._device_type = root._device_type
        view._full = root._full
        view._root = root
        view._axes = tuple(axes)
        view._names = tuple(names)
        view._coord = root._coord
        view._rank = root._rank
        view._flat = {}
        view._groups = tuple(groups)
        return view

    def _root_mesh(self) -> DeviceMesh:
        return self if self._root is None else self._root

    _get_root_mesh = _root_mesh  # torch's spelling

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
        return len(self._axes)

    @property
    def shape(self) -> tuple[int, ...]:
        dims = self._full.shape
        return tuple(math.prod(dims[a] for a in axes) for axes in self._axes)

    def size(self, mesh_dim: int | str | None = None) -> int:
        """The number of ranks in the mesh, or along ``mesh_dim``."""
        if mesh_dim is None:
            return math.prod(self.shape)
        return self.shape[self._dim_index(mesh_dim, "size")]

    @property
    def mesh(self) -> np.ndarray:
        """The global ranks of this mesh (for a submesh: the one holding this rank)."""
        full = self._full
        chosen = [a for axes in self._axes for a in axes]
        others = [a for a in range(full.ndim) if a not in chosen]
        stacked = full.transpose(others + chosen).reshape((-1,) + self.shape)
        if stacked.shape[0] == 1:
            return stacked[0].copy()
        if self._coord is None:
            raise RuntimeError("DeviceMesh.mesh: this rank is not in the mesh, and the submesh "
                               f"is one of {stacked.shape[0]}; there is no single answer")
        row = np.ravel_multi_index([self._coord[a] for a in others], [full.shape[a] for a in others])
        return stacked[int(row)].copy()

    # -- this rank ---------------------------------------------------------------

    def get_rank(self) -> int:
        """This process's global rank."""
        return self._rank

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's index along every dimension, or None if it is not in the mesh."""
        if self._coord is None:
            return None
        dims = self._full.shape
        return tuple(int(np.ravel_multi_index([self._coord[a] for a in axes],
                                              [dims[a] for a in axes])) for axes in self._axes)

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
        if isinstance(mesh_dim, bool) or not isinstance(mesh_dim, int):
            raise TypeError(f"DeviceMesh.{op}: mesh_dim must be an int or a name, got "
                            f"{type(mesh_dim).__name__}")
        if not -self.ndim <= mesh_dim < self.ndim:
            raise ValueError(f"DeviceMesh.{op}: mesh_dim {mesh_dim} is out of range for a "
                             f"{self.ndim}-D mesh")
        return mesh_dim % self.ndim

    def get_group(self, mesh_dim: int | str | None = None) -> ProcessGroup:
        """The group along ``mesh_dim`` (index or name) holding this rank.

        ``mesh_dim`` may be left out for a 1-D mesh.  On the root mesh it may also name
        a flattened dimension.

        Raises:
            RuntimeError: ``mesh_dim`` is None on a mesh of several dimensions, or this
                rank is not in the mesh.
        """
        if mesh_dim is None:
            if self.ndim != 1:
                raise RuntimeError(f"DeviceMesh.get_group: the mesh has {self.ndim} dimensions; "
                                   "pass mesh_dim, or use get_all_groups()")
            mesh_dim = 0
        if isinstance(mesh_dim, str) and (not self._names or mesh_dim not in self._names):
            flat = self._root_mesh()._flat.get(mesh_dim) if self._root is None else None
            if flat is not None:
                return flat.get_group()
        group = self._groups[self._dim_index(mesh_dim, "get_group")]
        if group is None or group is GroupMember.NON_GROUP_MEMBER:
            raise RuntimeError(f"DeviceMesh.get_group: global rank {self._rank} is not in the mesh "
                               f"{self._full.tolist() if self._full.size <= 64 else self.shape}")
        return group

    def get_all_groups(self) -> list[ProcessGroup]:
        """The groups of every dimension, in dimension order."""
        return [self.get_group(d) for d in range(self.ndim)]

    # -- slicing and flattening --------------------------------------------------

    def __getitem__(self, mesh_dim_names) -> DeviceMesh:
        """The submesh over the named dimensions (in mesh order), sharing their groups.

        No communication.  On the root mesh, names of flattened dimensions work too.
        """
        if not self._names:
            raise RuntimeError("DeviceMesh: cannot slice a mesh without mesh_dim_names")
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        if names == self._names:
            return self
        flat = self._flat if self._root is None else {}
        valid = list(self._names) + list(flat)
        axes, groups = [], []
        for n in names:
            if n in self._names:
                axes.append(self._axes[self._names.index(n)])
                groups.append(self._groups[self._names.index(n)])
            elif n in flat:
                axes.append(flat[n]._axes[0])
                groups.append(flat[n]._groups[0])
            else:
                raise MeshDimError(f"DeviceMesh[{names}]: no mesh dimension {n!r}; expected "
                                   f"names from {valid}")
        if len(set(names)) != len(names):
            raise MeshDimError(f"DeviceMesh[{names}]: a dimension is named twice")
        order = [a for ax in axes for a in ax]
        if order != sorted(order) or len(set(order)) != len(order):
            raise MeshDimError(f"DeviceMesh[{names}]: dimensions must be given in mesh order "
                               f"{valid} and must not overlap")
        return self._view(axes, names, groups)

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
        axes = tuple(a for ax in self._axes for a in ax)
        known = root._flat.get(name)
        if known is not None:
            if known._axes == (axes,):
                return known
            raise ValueError(f"{op}: a different flattened dimension is already named {name!r}")
        group = _dim_group(root, axes, name, None, root._timeout)
        flat = self._view((axes,), (name,), (group,))
        root._flat[name] = flat
        return flat

    _flatten = flatten  # torch's spelling

    # -- from existing groups ----------------------------------------------------

    @staticmethod
    def from_group(group, device_type: str, mesh=None, *, mesh_dim_names=None) -> DeviceMesh:
        """A mesh over existing groups: one group for a 1-D mesh, or a list with ``mesh``.

        No communication.  For several groups, ``mesh`` and ``mesh_dim_names`` are
        required and group ``i`` must be the one along dimension ``i`` through this rank.

        Raises:
            ValueError: ``mesh`` does not match the groups, or a required argument is missing.
        """
        op = "DeviceMesh.from_group"
        device_type = _check_device_type(device_type, op)
        world = default_group(op)
        if isinstance(group, ProcessGroup):
            ranks = group.ranks
            if mesh is not None and np.asarray(mesh).ravel().tolist() != ranks:
                raise ValueError(f"{op}: mesh {np.asarray(mesh).tolist()} does not match the "
                                 f"group's ranks {ranks}")
            full = np.array(ranks, dtype=np.int64)
            names = _check_names(mesh_dim_names, 1, op)
            return DeviceMesh._with_groups(device_type, full, names, [group])
        groups = list(group) if isinstance(group, (list, tuple)) else None
        if not groups:
            raise ValueError(f"{op}: expected a ProcessGroup or a non-empty list of them, got "
                             f"{group!r}")
        if mesh is None or mesh_dim_names is None:
            raise ValueError(f"{op}: mesh and mesh_dim_names are required with "
                             f"{len(groups)} groups")
        full = _check_mesh(mesh, world._size, op)
        if full.ndim != len(groups):
            raise ValueError(f"{op}: mesh has {full.ndim} dimensions, expected one per group "
                             f"({len(groups)})")
        names = _check_names(mesh_dim_names, full.ndim, op)
        coord = _locate(full, world._rank)
        checked = []
        for d, g in enumerate(groups):
            if coord is None:
                checked.append(GroupMember.NON_GROUP_MEMBER)
                continue
            if not isinstance(g, ProcessGroup):
                raise TypeError(f"{op}: group {d} must be a ProcessGroup, got {type(g).__name__}")
            line = full[tuple(slice(None) if a == d else coord[a] for a in range(full.ndim))]
            if sorted(line.tolist()) != sorted(g.ranks):
                raise ValueError(f"{op}: group {d} holds ranks {g.ranks}, but along dimension "
                                 f"{d} the mesh gives {line.tolist()} for rank {world._rank}")
            checked.append(g)
        return DeviceMesh._with_groups(device_type, full, names, checked)

    # -- identity ----------------------------------------------------------------

    def _key(self) -> tuple:
        return (self._full.shape, self._full.tobytes(), self._axes, self._device_type, self._names)

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
    from .group import world_state

    if world_state.world is None:  # torch's meshes initialise the default group too
        from .world import init_process_group

        init_process_group()
    return world_state.world


def init_device_mesh(device_type: str, mesh_shape, *, mesh_dim_names=None,
                     backend_override=None) -> DeviceMesh:
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
    device_type = _check_device_type(device_type, op)
    if isinstance(mesh_shape, int) and not isinstance(mesh_shape, bool):
        mesh_shape = (mesh_shape,)
    if not isinstance(mesh_shape, (tuple, list)) or not mesh_shape:
        raise TypeError(f"{op}: mesh_shape must be a non-empty tuple of ints, got {mesh_shape!r}")
    for s in mesh_shape:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s <= 0:
            raise ValueError(f"{op}: mesh_shape {tuple(mesh_shape)} must hold positive ints, "
                             f"got {s!r}")
    shape = tuple(int(s) for s in mesh_shape)
    names = _check_names(mesh_dim_names, len(shape), op)
    world = _default_or_init()
    if math.prod(shape) != world._size:
        raise ValueError(f"{op}: mesh_shape {shape} holds {math.prod(shape)} ranks, expected "
                         f"the world size ({world._size})")
    return DeviceMesh(device_type, np.arange(world._size).reshape(shape), mesh_dim_names=names,
                      backend_override=backend_override)
