"""BucketReducer: DistributedDataParallel's bucketed, overlapped gradient all-reduce.

Data parallelism averages every gradient over the data-parallel group before the
optimizer step.  One all_reduce per gradient pays the per-call cost once per
parameter; one all_reduce after backward leaves the network idle while backward
runs.  DDP's answer, reproduced here for numpy and cupy arrays::

    reducer = spmd.BucketReducer(grads, bucket_cap_mb=25, group=dp_group)
    for i in reversed(range(len(layers))):      # backward
        compute_grad(i)                          # writes grads[i] in place
        reducer.mark_ready(i)                    # a full bucket starts its all_reduce
    reducer.wait()                               # every gradient reduced, in place

Gradients are assigned to buckets in reverse registration order (backward makes the
last layer's gradients first), one dtype per bucket; a bucket is closed once it
holds ``bucket_cap_mb`` MiB (the first one at ``first_bucket_cap_mb``, small so that
communication starts early), as DDP's ``compute_bucket_assignment_by_size`` does.
When every gradient of a bucket is marked, the bucket is packed into its flat buffer
(allocated once; one vectorised copy; a single contiguous gradient is reduced where it
is) and all-reduced with ``async_op=True``; ``wait()`` copies the results back.
Buckets start strictly in bucket order on every rank, because the ranks' collectives
are matched by the order they are issued in: a bucket completed early waits for the
ones before it.  ``mark_ready`` also polls the buckets in flight, so MPI progresses
them while backward computes (MPI progresses only inside MPI calls).

With ``gradient_as_bucket_view=True`` (DDP's option) the gradients are views into
the bucket buffers (``reducer.grads``) and nothing is copied at all.

``compression="bf16"`` or ``"fp16"`` packs float32/float64 gradients into a buffer of
that dtype (torch's ``bf16_compress_hook``/``fp16_compress_hook``): half the bytes
on the wire, reduced in float32 and rounded once, cast back into the gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from spmd.api.collectives import all_reduce
from spmd.core.arrays import SUPPORTED_DTYPES, bfloat16
from spmd.core.errors import located
from spmd.core.ops import ReduceOp
from spmd.core.work import Work
from spmd.runtime.group import ProcessGroup, resolve

__all__ = ["DEFAULT_FIRST_BUCKET_CAP_MB", "BucketReducer"]

DEFAULT_FIRST_BUCKET_CAP_MB = 1.0  # DDP's dist._DEFAULT_FIRST_BUCKET_BYTES
_MIB = 1 << 20
_COMPRESSIONS = ("bf16", "fp16")


def _is_gpu(a: Any) -> bool:
    return not isinstance(a, np.ndarray) and hasattr(a, "__cuda_array_interface__")


class _Bucket:
    """One bucket: its gradients, how many are still unmarked, its reduction in flight.

    ``buf`` is the flat buffer that is all-reduced (None: the lone gradient itself);
    with ``views`` the gradients are views into it and nothing is copied.
    """

    __slots__ = ("arrays", "buf", "indices", "pending", "views", "work")

    def __init__(self, indices: list[int], arrays: list, wire: np.dtype, as_view: bool) -> None:
        self.indices = indices
        self.pending = len(indices)
        self.work: Work | None = None
        a = arrays[0]
        self.views = as_view and np.dtype(a.dtype) == wire
        if len(arrays) == 1 and np.dtype(a.dtype) == wire and a.flags.c_contiguous:
            self.buf, self.views = None, False
        elif isinstance(a, np.ndarray):
            self.buf = np.empty(sum(x.size for x in arrays), wire)
        else:
            import cupy

            self.buf = cupy.empty(sum(x.size for x in arrays), wire)
        if self.views:
            assert self.buf is not None  # views were turned off where there is no buffer
            # DDP's gradient_as_bucket_view: the gradients live in the bucket buffer.
            views, pos = [], 0
            for x in arrays:
                v = self.buf[pos:pos + x.size].reshape(x.shape)
                v[...] = x
                views.append(v)
                pos += x.size
            arrays = views
        self.arrays = arrays


class BucketReducer:
    """Average (or sum) gradients over a group in DDP's buckets, overlapped with backward.

    Every rank of the group must build it with gradients of the same shapes and dtypes
    in the same order, and mark every gradient once per step before ``wait()``.

    Args:
        grads: the gradient arrays (numpy or cupy, not mixed), reduced in place; the
            reducer keeps references, so write into these arrays every step.
        bucket_cap_mb: MiB of gradients per bucket (DDP's default 25).
        group: the data-parallel group (WORLD if None).
        op: the reduction, ``ReduceOp.AVG`` (DDP's average) by default.
        first_bucket_cap_mb: MiB of the first bucket; ``min(1, bucket_cap_mb)`` if None.
        compression: None, ``"bf16"`` or ``"fp16"``: the wire dtype of float32/float64
            gradients.
        gradient_as_bucket_view: as DDP's option: the reducer allocates the gradients
            as views into its bucket buffers (initialised from ``grads``), so buckets
            are reduced with no packing copies; write into ``reducer.grads`` then.
            Not for compressed buckets, whose wire dtype differs.

    Raises:
        TypeError: a gradient that is not an array, of an unsupported dtype, numpy and
            cupy mixed, or compression of non-float gradients.
        ValueError: no gradients, a read-only gradient, one array given twice, caps
            that are not positive, an unknown compression.
    """

    def __init__(self, grads: Sequence[Any], bucket_cap_mb: float = 25.0, group: Any = None,
                 op: Any = ReduceOp.AVG, *, first_bucket_cap_mb: float | None = None,
                 compression: str | None = None, gradient_as_bucket_view: bool = False
                 ) -> None:
        op_name = "BucketReducer"
        pg = resolve(group, op_name)
        if pg is None:
            raise ValueError(f"{op_name}: this rank is not a member of the group")
        self._pg: ProcessGroup = pg
        self._op = op
        grads = list(grads) if isinstance(grads, (list, tuple)) else grads
        if not isinstance(grads, list):
            raise located(TypeError, op_name, f"grads must be a list of arrays, got "
                          f"{type(grads).__name__}", pg.context)
        if not grads:
            raise located(ValueError, op_name, "grads is empty", pg.context)
        caps = {"bucket_cap_mb": bucket_cap_mb, "first_bucket_cap_mb": (
            min(DEFAULT_FIRST_BUCKET_CAP_MB, bucket_cap_mb)
            if first_bucket_cap_mb is None else first_bucket_cap_mb)}
        for arg, cap in caps.items():
            if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
                raise located(ValueError, op_name, f"{arg} must be a positive number, got "
                              f"{cap!r}", pg.context)
        if compression not in (None, *_COMPRESSIONS):
            raise located(ValueError, op_name, f"compression must be None, 'bf16' or 'fp16', "
                          f"got {compression!r}", pg.context)
        if compression == "bf16" and bfloat16 is None:
            raise located(TypeError, op_name, "compression='bf16' needs ml_dtypes "
                          "(pip install spmd[bf16])", pg.context)
        self._check_grads(grads, compression, op_name)
        if compression == "bf16" and _is_gpu(grads[0]):
            raise located(TypeError, op_name, "compression='bf16' is for numpy gradients (CuPy "
                          "has no bfloat16); use 'fp16' for GPU gradients", pg.context)
        self._grads = list(grads)
        self._gpu = _is_gpu(grads[0])
        wire = {None: None, "bf16": bfloat16, "fp16": np.dtype(np.float16)}[compression]
        self._buckets = self._assign(grads, int(caps["bucket_cap_mb"] * _MIB),
                                     int(caps["first_bucket_cap_mb"] * _MIB), wire,
                                     bool(gradient_as_bucket_view))
        for bucket in self._buckets:
            for i, a in zip(bucket.indices, bucket.arrays):
                self._grads[i] = a
        self._bucket_of = [0] * len(grads)
        for b, bucket in enumerate(self._buckets):
            for i in bucket.indices:
                self._bucket_of[i] = b
        self._marked = [False] * len(grads)
        self._next = 0  # the next bucket to start

    def _check_grads(self, grads: list, compression: str | None, op: str) -> None:
        pg = self._pg
        gpu = _is_gpu(grads[0])
        bounds = []
        for i, g in enumerate(grads):
            if not isinstance(g, np.ndarray) and not _is_gpu(g):
                raise located(TypeError, op, f"grads[{i}] must be a numpy or cupy array, got "
                              f"{type(g).__name__}", pg.context)
            if _is_gpu(g) != gpu:
                raise located(TypeError, op, f"grads[{i}] is a {'GPU' if _is_gpu(g) else 'host'}"
                              f" array but grads[0] is not: numpy and cupy gradients cannot be "
                              "mixed", pg.context)
            dt = np.dtype(g.dtype)
            if dt not in SUPPORTED_DTYPES:
                raise located(TypeError, op, f"grads[{i}] has unsupported dtype {dt}", pg.context)
            if compression is not None and dt.kind != "f" and dt != bfloat16:
                raise located(TypeError, op, f"compression={compression!r} casts floating-point "
                              f"gradients, but grads[{i}] has dtype {dt}", pg.context)
            if isinstance(g, np.ndarray):
                if not g.flags.writeable:
                    raise located(ValueError, op, f"grads[{i}] is read-only; gradients are "
                                  "reduced in place", pg.context)
                if g.size:
                    # numpy 2 moved byte_bounds; the stubs are numpy 2's, the fallback is
                    # for numpy 1.x
                    lo, hi = np.lib.array_utils.byte_bounds(g) if hasattr(
                        np.lib, "array_utils") else np.byte_bounds(g)  # type: ignore[attr-defined]
                    bounds.append((lo, hi, i))
        # Two gradients sharing memory would be reduced twice.
        bounds.sort()
        for (_, hi, i), (lo, _, j) in pairwise(bounds):
            if lo < hi and np.shares_memory(grads[i], grads[j]):
                raise located(ValueError, op, f"grads[{i}] and grads[{j}] share memory; each "
                              "gradient must be its own array", pg.context)

    @staticmethod
    def _assign(grads: list, cap: int, first_cap: int, wire: np.dtype | None,
                as_view: bool) -> list[_Bucket]:
        """DDP's assignment: reverse order, one open bucket per dtype, closed at its cap."""
        open_: dict[np.dtype, tuple[list[int], int]] = {}
        closed: dict[np.dtype, int] = {}
        done: list[list[int]] = []
        for i in reversed(range(len(grads))):
            dt = np.dtype(grads[i].dtype)
            indices, size = open_.get(dt, ([], 0))
            indices.append(i)
            size += grads[i].nbytes
            limit = first_cap if closed.get(dt, 0) == 0 else cap
            if size >= limit:
                done.append(indices)
                closed[dt] = closed.get(dt, 0) + 1
                open_.pop(dt, None)
            else:
                open_[dt] = (indices, size)
        done.extend(indices for indices, _ in open_.values())
        # The bucket holding the last gradients first: the order backward fills them.
        done.sort(key=lambda ix: -ix[0])
        out = []
        for indices in done:
            dt = np.dtype(grads[indices[0]].dtype)
            w = wire if wire is not None and dt.kind == "f" and dt.itemsize > 2 else dt
            out.append(_Bucket(indices, [grads[i] for i in indices], w, as_view))
        return out

    @property
    def buckets(self) -> list[list[int]]:
        """The gradient indices of every bucket, in the order the buckets are reduced."""
        return [list(b.indices) for b in self._buckets]

    @property
    def grads(self) -> list:
        """The gradients the reducer reduces.

        ``grads`` as given, or with ``gradient_as_bucket_view`` the views into the
        bucket buffers.
        """
        return list(self._grads)

    @property
    def group(self) -> ProcessGroup:
        return self._pg

    def mark_ready(self, index: int) -> None:
        """Mark ``grads[index]`` final for this step; start every bucket that is complete
        and whose predecessors have started.

        Raises:
            TypeError, ValueError: ``index`` is not an int in ``range(len(grads))``.
            RuntimeError: ``index`` was already marked in this step.
        """
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise located(TypeError, "BucketReducer.mark_ready", f"index must be an int, got "
                          f"{type(index).__name__}", self._pg.context)
        n = len(self._grads)
        if not -n <= index < n:
            raise located(ValueError, "BucketReducer.mark_ready", f"index {index} is out of "
                          f"range: expected 0 <= index < {n}", self._pg.context)
        index = int(index) % n
        if self._marked[index]:
            raise located(RuntimeError, "BucketReducer.mark_ready", f"grads[{index}] was already "
                          "marked ready in this step (call wait() to end the step)", self._pg.context)
        self._marked[index] = True
        self._buckets[self._bucket_of[index]].pending -= 1
        buckets = self._buckets
        while self._next < len(buckets) and buckets[self._next].pending == 0:
            self._start(buckets[self._next])
            self._next += 1
        # Drive the reductions in flight: MPI progresses only inside MPI calls.
        for b in buckets[:self._next]:
            if b.work is not None and not b.work.is_completed():
                break

    def _start(self, b: _Bucket) -> None:
        buf = b.buf
        if buf is None:  # a lone contiguous gradient of the wire dtype: reduced in place
            buf = b.arrays[0]
        elif b.views:
            pass
        elif self._gpu:
            import cupy

            cupy.concatenate([a.ravel() for a in b.arrays], out=buf)
        else:
            # One vectorised copy (casting to the wire dtype) into the bucket's own
            # buffer, allocated once: a fresh buffer per step would page-fault anew.
            np.concatenate([a.reshape(-1) for a in b.arrays], out=buf, casting="unsafe")
        b.work = all_reduce(buf, op=self._op, group=self._pg, async_op=True)

    def wait(self) -> None:
        """Wait for every bucket; the gradients then hold the reduced values.  Ends the
        step: the next step marks every gradient again.

        Raises:
            RuntimeError: some gradients were not marked in this step (nothing waited).
            DistTimeoutError: a bucket's all_reduce did not complete in the group's time.
        """
        if self._next < len(self._buckets):
            missing = [i for i, m in enumerate(self._marked) if not m]
            shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
            raise located(RuntimeError, "BucketReducer.wait", f"{len(missing)} of "
                          f"{len(self._grads)} gradients were not marked ready in this step "
                          f"(grads {shown}); every rank must mark every gradient before wait()",
                          self._pg.context)
        try:
            for b in self._buckets:
                assert b.work is not None  # every bucket was started (checked above)
                b.work.wait()
                if b.buf is not None and not b.views:
                    pos = 0
                    for a in b.arrays:
                        a[...] = b.buf[pos:pos + a.size].reshape(a.shape)
                        pos += a.size
        finally:
            for b in self._buckets:
                b.pending, b.work = len(b.indices), None
            self._marked = [False] * len(self._grads)
            self._next = 0

    def __repr__(self) -> str:
        return (f"<BucketReducer {len(self._grads)} grads in {len(self._buckets)} buckets, "
                f"group={self._pg.name}>")
