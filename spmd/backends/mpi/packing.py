"""Packing many arrays into few buffers: the buckets of fused collectives.

Buckets hold up to ``get_bucket_bytes()`` bytes (128 MiB, Horovod's default fusion
threshold; ``SPMD_FUSION_BYTES`` or :func:`set_bucket_bytes` change it); a larger array
is a bucket of its own.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from mpi4py import MPI

from spmd.core import settings

__all__ = ["ArrayPieces", "get_bucket_bytes", "set_bucket_bytes", "buckets", "pack", "unpack",
           "pack_buckets", "Packed", "PackPlan", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 128 * 1024 * 1024


def _env_bucket_bytes() -> int:
    return int(settings.read("SPMD_FUSION_BYTES"))


_bucket_bytes = _env_bucket_bytes()


def get_bucket_bytes() -> int:
    """The largest number of bytes packed into one fused collective."""
    return _bucket_bytes


def set_bucket_bytes(nbytes: int) -> None:
    """Set the fusion threshold of this process; every rank must use the same value.

    Raises:
        TypeError, ValueError: ``nbytes`` is not a positive int.
    """
    global _bucket_bytes
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"set_bucket_bytes: nbytes must be an int, got {type(nbytes).__name__}")
    if nbytes <= 0:
        raise ValueError(f"set_bucket_bytes: nbytes must be positive, got {nbytes}")
    _bucket_bytes = nbytes


def buckets(arrays: list, limit: int | None = None) -> list[list]:
    """Split ``arrays`` (in order) into runs of at most ``limit`` bytes each; an array
    larger than the limit is a run of its own."""
    limit = _bucket_bytes if limit is None else limit
    out: list[list] = []
    run: list = []
    size = 0
    for a in arrays:
        nbytes = a.nbytes
        if run and size + nbytes > limit:
            out.append(run)
            run, size = [], 0
        run.append(a)
        size += nbytes
    if run:
        out.append(run)
    return out


# -- packing -------------------------------------------------------------------------

# From this many arrays on, an MPI datatype listing every array's address (hindexed,
# in bytes) packs and unpacks a bucket in one C call each; below it numpy copies are
# cheaper than building the datatype.  Per array that is about 2 us of Python less
# than slicing, reshaping and np.copyto.
_MANY = 8
_get_address = MPI.Get_address
_BYTE = MPI.BYTE
_BOTTOM = MPI.BOTTOM
_self_comm = None


def _self():
    """A private duplicate of COMM_SELF: the local copies never meet user messages."""
    global _self_comm
    if _self_comm is None:
        _self_comm = MPI.COMM_SELF.Dup()
    return _self_comm


class Packed:
    """One bucket: the buffer MPI reduces, and how its result goes back to the arrays.

    ``arrays`` is None when ``buf`` is the caller's own array (reduced in place).
    """

    __slots__ = ("arrays", "buf", "_layout")

    def __init__(self, arrays: list[np.ndarray] | None, buf: np.ndarray,
                 layout: MPI.Datatype | None = None):
        self.arrays = arrays
        self.buf = buf
        self._layout = layout

    def unpack(self) -> None:
        """Copy the buffer back into the arrays (cast to their dtypes)."""
        if self.arrays is None:
            return
        layout = self._layout
        if layout is not None:
            self._layout = None
            try:
                _self().Sendrecv([self.buf, _BYTE], 0, 0, [_BOTTOM, 1, layout], 0, 0)
            finally:
                layout.Free()
            return
        unpack(self.arrays, self.buf)


def pack_buckets(arrays: list, dtype: np.dtype, in_place: bool = True, limit: int | None = None
                 ) -> list[Packed]:
    """Pack ``arrays`` into buffers of ``dtype`` of at most ``limit`` bytes each
    (``get_bucket_bytes()`` if None).  With ``in_place``, a contiguous array of
    ``dtype`` alone in its bucket is used as it is."""
    limit = _bucket_bytes if limit is None else limit
    sizes = [a.nbytes for a in arrays]
    direct = len(arrays) >= _MANY and all(
        (a.dtype is dtype or a.dtype == dtype) and a.flags.c_contiguous for a in arrays)
    addrs = [_get_address(a) for a in arrays] if direct else None
    out: list[Packed] = []
    lo = 0
    while lo < len(arrays):
        hi, total = lo + 1, sizes[lo]
        while hi < len(arrays) and total + sizes[hi] <= limit:
            total += sizes[hi]
            hi += 1
        run = arrays[lo:hi]
        if hi - lo == 1 and in_place and run[0].dtype == dtype and run[0].flags.c_contiguous:
            out.append(Packed(None, run[0]))
        elif direct and hi - lo >= _MANY:
            assert addrs is not None  # taken above for direct packing
            layout = _BYTE.Create_hindexed(sizes[lo:hi], addrs[lo:hi]).Commit()
            buf = np.empty(total // dtype.itemsize, dtype)
            try:
                _self().Sendrecv([_BOTTOM, 1, layout], 0, 0, [buf, _BYTE], 0, 0)
            except BaseException:
                layout.Free()
                raise
            out.append(Packed(run, buf, layout))
        else:
            out.append(Packed(run, pack(run, dtype)))
        lo = hi
    return out


class ArrayPieces:
    """The arrays of one fused all-reduce as consecutive pieces of one buffer, in numpy:
    what ``_fastcall.Pieces`` does in C, for arrays it does not take (views, mixed
    layouts) and where the extension is off.  The shared-memory engine gathers them into
    its window and scatters the result back."""

    __slots__ = ("arrays", "dtype", "nbytes")

    def __init__(self, arrays: list, dtype: np.dtype):
        self.arrays = arrays
        self.dtype = dtype
        self.nbytes = sum(a.nbytes for a in arrays)

    def _as_items(self, buf: np.ndarray) -> np.ndarray:
        # The first nbytes of ``buf`` (any flat numpy array: a window slot's bytes, a
        # packed buffer), as the arrays' dtype.
        return buf.reshape(-1).view(np.uint8)[:self.nbytes].view(self.dtype)

    def gather(self, dst: np.ndarray) -> None:
        """Copy the arrays, in order, into the start of ``dst``."""
        flat = self._as_items(dst)
        pos = 0
        for a in self.arrays:
            flat[pos:pos + a.size] = a.reshape(-1)
            pos += a.size

    stream_into = gather   # (the C type's streams past the cache; numpy cannot)

    def scatter(self, src: np.ndarray) -> None:
        """Copy consecutive pieces of the start of ``src`` into the arrays."""
        unpack(self.arrays, self._as_items(src))

    def sum_from(self, sources: list) -> bool:
        """Summing straight into the arrays is the C type's; here the engine reduces with
        numpy and scatters."""
        return False


class PackPlan:
    """The same arrays packed into the same buffers again and again (a persistent fused
    collective): each bucket's layout, an MPI datatype listing its arrays' addresses,
    is built once, so packing or unpacking a bucket is one C call however many arrays
    it holds.  An array alone in its bucket is its own buffer (nothing to copy).

    ``arrays`` must be C-contiguous host arrays of ``dtype``, alive and unmoved while
    the plan is used; ``free()`` releases the datatypes.
    """

    __slots__ = ("bufs", "_copies")

    def __init__(self, arrays: list[np.ndarray], dtype: np.dtype, limit: int | None = None):
        self.bufs: list[np.ndarray] = []
        self._copies: list[tuple[np.ndarray, MPI.Datatype]] = []   # (buffer, layout)
        try:
            for run in buckets(arrays, limit):
                if len(run) == 1:
                    self.bufs.append(run[0].reshape(-1))
                    continue
                sizes = [a.nbytes for a in run]
                layout = _BYTE.Create_hindexed(sizes, [_get_address(a) for a in run]).Commit()
                buf = np.empty(sum(sizes) // dtype.itemsize, dtype)
                self._copies.append((buf, layout))
                self.bufs.append(buf)
        except BaseException:
            self.free()
            raise

    def pack(self) -> None:
        """Copy the arrays into the buffers."""
        comm = _self()
        for buf, layout in self._copies:
            comm.Sendrecv([_BOTTOM, 1, layout], 0, 0, [buf, _BYTE], 0, 0)

    def unpack(self) -> None:
        """Copy the buffers back into the arrays."""
        comm = _self()
        for buf, layout in self._copies:
            comm.Sendrecv([buf, _BYTE], 0, 0, [_BOTTOM, 1, layout], 0, 0)

    def free(self) -> None:
        for _, layout in self._copies:
            layout.Free()
        self._copies = []


def pack(arrays: list, dtype: npt.DTypeLike) -> np.ndarray:
    """The arrays, flattened and concatenated into one new buffer of ``dtype``."""
    dtype = np.dtype(dtype)
    if not arrays:
        return np.empty(0, dtype)
    if all(a.ndim == 1 for a in arrays):
        return np.concatenate(arrays, dtype=dtype, casting="unsafe")
    return np.concatenate([a.reshape(-1) for a in arrays], dtype=dtype, casting="unsafe")


def unpack(outputs: list, buf: np.ndarray) -> None:
    """Copy consecutive pieces of ``buf`` into ``outputs`` (cast to their dtypes)."""
    pos = 0
    for o in outputs:
        end = pos + o.size
        np.copyto(o, buf[pos:end].reshape(o.shape), casting="unsafe")
        pos = end


# -- the manager ---------------------------------------------------------------------
