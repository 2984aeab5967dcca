"""Where each mesh dimension's ranks sit in the root mesh: (size, stride) modes.

A mesh dimension is a tuple of modes ``(size, stride)``, slowest first, over the root
mesh's ranks in row-major order (its "rank map"): the dimension's i-th element sits at
``sum(digit_k * stride_k)`` where the digits are i written row-major in the sizes.  A
root dimension is one mode; flattening concatenates modes; unflattening splits them.
This is the bookkeeping torch's DeviceMesh does with CuTe layouts
(``torch/distributed/_mesh_layout.py``), in lexicographic order as torch uses it, so
that the same meshes and groups come out.  Pure arithmetic: no MPI, no groups.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

__all__ = ["Modes", "coalesce", "collapse", "compose", "coordinate", "digit_base",
           "fits", "offsets", "row_major", "size", "sorted_descending"]

Modes = tuple[tuple[int, int], ...]


def coalesce(modes) -> Modes:
    """Drop size-1 modes and merge neighbours that are one contiguous run.

    Equal layouts get equal tuples, so layouts compare and hash like torch's.
    """
    out: list[tuple[int, int]] = []
    for size, stride in modes:
        if size == 1:
            continue
        if out and out[-1][1] == size * stride:  # the slower mode continues this one
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((int(size), int(stride)))
    return tuple(out)


def row_major(shape: tuple[int, ...]) -> tuple[Modes, ...]:
    """One single-mode dimension per axis of a row-major array of ``shape``."""
    return tuple(coalesce([(s, math.prod(shape[d + 1:]))]) for d, s in enumerate(shape))


def collapse(layout) -> Modes:
    """All dimensions as one (flattening): their modes in order, coalesced."""
    return coalesce([m for dim in layout for m in dim])


def size(modes: Modes) -> int:
    """The number of elements along a dimension."""
    return math.prod(s for s, _ in modes)


def offsets(modes: Modes) -> np.ndarray:
    """Rank-map offsets of every element of the dimension, in order (first is 0)."""
    out = np.zeros(1, dtype=np.int64)
    for s, d in modes:
        out = (out[:, None] + np.arange(s, dtype=np.int64)[None, :] * d).ravel()
    return out


def sorted_descending(modes: Modes) -> bool:
    """Strides from largest to smallest: dimensions taken in mesh order."""
    strides = [d for _, d in modes]
    return strides == sorted(strides, reverse=True)


def fits(modes: Modes, n: int) -> bool:
    """True if copies of ``modes`` tile the n-entry rank map without overlap.

    Sorted by stride, each mode must stride over everything finer than it, and the
    coarsest must divide n: then every index is one digit per mode plus a base, and
    the copies (the groups of a dimension) are disjoint.
    """
    ordered = sorted(modes, key=lambda m: m[1], reverse=True)
    for (_, big), (s, d) in itertools.pairwise(ordered):
        if big % (s * d):
            return False
    return not ordered or n % (ordered[0][0] * ordered[0][1]) == 0


def digit_base(index, modes: Modes):
    """(digits of ``index`` along ``modes``, the base of its copy); arrays work too."""
    digits = [(index // d) % s for s, d in modes]
    base = index - sum(c * d for c, (_, d) in zip(digits, modes))
    return digits, base


def coordinate(index: int, modes: Modes) -> int:
    """The position along a dimension of the rank-map entry ``index``."""
    digits, _ = digit_base(index, modes)
    pos = 0
    for c, (s, _) in zip(digits, modes):
        pos = pos * s + int(c)
    return pos


def compose(modes: Modes, sizes: tuple[int, ...]) -> tuple[Modes, ...]:
    """Split one dimension into row-major sub-dimensions of ``sizes`` (unflatten).

    Sub-dimension j steps through the dimension with stride ``prod(sizes[j+1:])``;
    each step must land on whole digits of its modes.

    Raises:
        ValueError: the product of ``sizes`` is not the dimension's size, or a
            sub-dimension would cut a mode unevenly (no layout can express it).
    """
    total = size(modes)
    if math.prod(sizes) != total:
        raise ValueError(f"sizes {tuple(sizes)} hold {math.prod(sizes)} elements, expected the "
                         f"dimension's size ({total})")
    out = []
    for j, want in enumerate(sizes):
        step, left, parts = math.prod(sizes[j + 1:]), want, []
        for s, d in reversed(modes):  # fastest mode first
            if left == 1:
                break
            if step >= s:
                if step % s:
                    raise ValueError(f"cannot split a dimension of modes {modes} into {sizes}: "
                                     f"a step of {step} cuts a mode of size {s}")
                step //= s
                continue
            if s % step:
                raise ValueError(f"cannot split a dimension of modes {modes} into {sizes}: "
                                 f"a step of {step} cuts a mode of size {s}")
            take = min(left, s // step)
            if left % take:
                raise ValueError(f"cannot split a dimension of modes {modes} into {sizes}: "
                                 f"{left} elements do not fill modes of size {s // step}")
            parts.append((take, d * step))
            left //= take
            step = 1
        out.append(coalesce(reversed(parts)))
    return tuple(out)
