"""Shard: the block of a global array one rank holds, and the common ways to lay them out.

Re-exported as ``spmd.checkpoint.Shard``.  A Shard only describes where its block sits
(``offset`` into ``global_shape``); whether the blocks of all ranks fit together is
checked collectively by ``checkpoint.save``/``load``, so that a wrong block raises the
same error on every rank instead of on one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from spmd.api.objects import all_gather_object
from spmd.core.errors import located
from spmd.runtime.group import resolve

if TYPE_CHECKING:  # DeviceMesh sits in this layer too: no import of it at run time
    from spmd.layouts.mesh import DeviceMesh

__all__ = ["Shard", "is_array"]


def is_array(x: Any) -> bool:
    """A numpy array, or a GPU array (anything exposing ``__cuda_array_interface__``)."""
    return isinstance(x, np.ndarray) or hasattr(x, "__cuda_array_interface__")


def _int_tuple(value: Any, what: str) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, (Sequence, np.ndarray)) or isinstance(value, str):
        raise TypeError(f"checkpoint.Shard: {what} must be a tuple of int, got "
                        f"{type(value).__name__}")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"checkpoint.Shard: {what} must be a tuple of int, got {value!r}")
        out.append(int(v))
    return tuple(out)


class Shard:
    """A block of a global array: ``global[offset[0]:offset[0]+data.shape[0], ...] = data``.

    Args:
        data: this rank's block (numpy or cupy; any strides).  ``save`` reads it,
            ``load`` fills it in place.
        global_shape: the shape of the whole array.
        offset: where the block starts in the global array, one index per dimension.

    Raises:
        TypeError: ``data`` is not an array, or the shapes are not tuples of int.
        ValueError: ``global_shape``/``offset`` do not have ``data.ndim`` entries.
    """

    __slots__ = ("data", "global_shape", "offset")

    def __init__(self, data: Any, global_shape: Sequence[int], offset: Sequence[int]) -> None:
        if not is_array(data):
            raise TypeError(f"checkpoint.Shard: data must be a numpy or cupy array, got "
                            f"{type(data).__name__}")
        self.data = data
        self.global_shape = _int_tuple(global_shape, "global_shape")
        self.offset = _int_tuple(offset, "offset")
        if not len(self.global_shape) == len(self.offset) == data.ndim:
            raise ValueError(f"checkpoint.Shard: data is {data.ndim}-D {tuple(data.shape)} but "
                             f"global_shape is {self.global_shape} and offset {self.offset}: "
                             "expected one entry per dimension of data")

    @property
    def shape(self) -> tuple[int, ...]:
        """The block's shape (``data.shape``)."""
        return tuple(self.data.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.data.dtype)

    def __repr__(self) -> str:
        return (f"Shard({self.shape} {self.dtype} at {self.offset} of {self.global_shape})")

    # -- layouts ---------------------------------------------------------------------

    @classmethod
    def split(cls, data: Any, dim: int = 0, global_shape: Sequence[int] | None = None,
              group: Any = None) -> Shard:
        """The Shard of ``data`` when the ranks of ``group`` hold consecutive pieces of
        the global array along ``dim``, in group-rank order (pieces may differ in size).

        Collective: every rank of the group calls it (one small all-gather of shapes).

        Args:
            data: this rank's piece.
            dim: the dimension the global array is split along.
            global_shape: the expected global shape (checked), or None to infer it.
            group: the group the pieces are spread over (WORLD if None).

        Raises:
            ValueError: the pieces do not fit together (different ndim, or different
                sizes outside ``dim``), or do not add up to ``global_shape``; raised on
                every rank alike.
        """
        op = "checkpoint.Shard.split"
        pg = resolve(group, op)
        if pg is None:
            raise ValueError(f"{op}: this rank is not a member of the group")
        if not is_array(data):
            raise located(TypeError, op, f"data must be a numpy or cupy array, got "
                          f"{type(data).__name__}", pg.context)
        shapes: list = [None] * pg.size()
        all_gather_object(shapes, tuple(data.shape), group=pg)
        ndim = len(shapes[0])
        d = dim + ndim if isinstance(dim, int) and -ndim <= dim < 0 else dim
        for r, s in enumerate(shapes):
            if not isinstance(d, int) or not 0 <= d < max(ndim, 1) or len(s) != ndim:
                raise located(ValueError, op, f"cannot split along dim {dim}: pieces have "
                              f"shapes {shapes} (group ranks in order)", pg.context)
            if s[:d] + s[d + 1:] != shapes[0][:d] + shapes[0][d + 1:]:
                raise located(ValueError, op, f"pieces must agree outside dim {d}: group "
                              f"rank {r} has {s}, group rank 0 has {shapes[0]}", pg.context)
        gshape = list(shapes[0])
        gshape[d] = sum(s[d] for s in shapes)
        if global_shape is not None and tuple(gshape) != _int_tuple(global_shape, "global_shape"):
            raise located(ValueError, op, f"the pieces make a global array of shape "
                          f"{tuple(gshape)}, expected global_shape {tuple(global_shape)}", pg.context)
        offset = [0] * ndim
        offset[d] = sum(s[d] for s in shapes[:pg.rank()])
        return cls(data, gshape, offset)

    @classmethod
    def empty(cls, global_shape: Sequence[int], dtype: Any, dim: int = 0,
              group: Any = None) -> Shard:
        """A new numpy block of this rank's piece of ``global_shape`` split along ``dim``
        as ``numpy.array_split`` splits it (the first ``n % size`` ranks get one more).

        Not collective.  The usual target of ``checkpoint.load`` at a new world size.
        """
        op = "checkpoint.Shard.empty"
        pg = resolve(group, op)
        if pg is None:
            raise ValueError(f"{op}: this rank is not a member of the group")
        gshape = _int_tuple(global_shape, "global_shape")
        if not -len(gshape) <= dim < len(gshape):
            raise located(ValueError, op, f"dim {dim} is out of range for global_shape "
                          f"{gshape}", pg.context)
        dim %= len(gshape)
        base, extra = divmod(gshape[dim], pg.size())
        r = pg.rank()
        shape, offset = list(gshape), [0] * len(gshape)
        shape[dim] = base + (r < extra)
        offset[dim] = r * base + min(r, extra)
        return cls(np.empty(shape, dtype), gshape, offset)

    @classmethod
    def from_mesh(cls, data: Any, mesh: DeviceMesh, dims: Mapping[int, int | str]) -> Shard:
        """The Shard of ``data`` laid out on a DeviceMesh: array dimension ``d`` is split
        over mesh dimension ``dims[d]`` (as :meth:`split` does, in that dimension's
        group), and replicated along every mesh dimension not named.

        ``{0: "tp"}`` is torch's ``[Shard(0)]`` on a 1-D mesh, ``{0: "dp", 1: "tp"}`` a
        2-D block layout.  Replicas hold identical blocks; ``save`` writes one of them.
        Collective over the group of every named mesh dimension.

        Raises:
            ValueError: a mesh dimension named twice, or pieces that do not fit together.
        """
        if not (hasattr(mesh, "get_group") and hasattr(mesh, "mesh_dim_names")):
            raise TypeError(f"checkpoint.Shard.from_mesh: mesh must be a DeviceMesh, got "
                            f"{type(mesh).__name__}")
        if not isinstance(dims, Mapping):
            raise TypeError("checkpoint.Shard.from_mesh: dims must map array dimensions to "
                            f"mesh dimensions, got {type(dims).__name__}")
        names = mesh.mesh_dim_names or ()
        which = [names.index(m) if isinstance(m, str) and m in names else m
                 for m in dims.values()]
        if len(set(which)) != len(which):
            raise ValueError(f"checkpoint.Shard.from_mesh: dims {dict(dims)} names a mesh "
                             "dimension twice")
        groups = [mesh.get_group(m) for m in dims.values()]
        gshape, offset = list(data.shape), [0] * data.ndim
        for d, g in zip(dims, groups):
            piece = cls.split(data, d, None, g)
            d = d % data.ndim
            gshape[d], offset[d] = piece.global_shape[d], piece.offset[d]
        return cls(data, gshape, offset)
