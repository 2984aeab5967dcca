"""Fusion of small collectives: many arrays, one collective per bucket.

Issuing one collective per small array pays the per-call cost (Python, MPI, latency)
once per array.  Packing arrays of one dtype into a buffer and reducing it once pays
it once per bucket.  Two ways in:

- ``spmd.all_reduce_coalesced(tensors)``: one call, a list of arrays.
- ``coalescing_manager()``: ops issued inside the block are recorded, not started;
  when the block ends they run fused, and the manager holds one Work for the batch::

      with spmd.coalescing_manager(async_ops=True) as cm:
          for g in grads:
              spmd.all_reduce(g)
      cm.wait()

Buckets hold up to ``get_bucket_bytes()`` bytes (128 MiB, Horovod's default fusion
threshold; ``SPMD_FUSION_BYTES`` or :func:`set_bucket_bytes` change it); a larger array
is reduced alone, in place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from spmd.backends.mpi.packing import (
    DEFAULT_BUCKET_BYTES,
    Packed,
    buckets,
    get_bucket_bytes,
    pack,
    pack_buckets,
    set_bucket_bytes,
    unpack,
)
from spmd.core.errors import located
from spmd.core.ops import ReduceOp
from spmd.core.typing import Timeout
from spmd.core.work import Work, then
from spmd.runtime.group import GroupArg, resolve

__all__ = ["coalescing_manager", "CoalescingManager", "get_bucket_bytes", "set_bucket_bytes",
           "buckets", "pack", "unpack", "pack_buckets", "Packed", "DEFAULT_BUCKET_BYTES"]

_FUSABLE = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


class _Pending:
    """What a collective returns inside the block: it runs when the block ends."""

    __slots__ = ("_cm",)

    def __init__(self, cm: CoalescingManager):
        self._cm = cm

    def wait(self, timeout=None) -> bool:
        # Inside the block this is the blocking call's own wait: nothing has started yet.
        if self._cm._issued:
            self._cm.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return self._cm._issued and all(w.is_completed() for w in self._cm.works)

    def is_success(self) -> bool:
        return self.is_completed() and all(w.is_success() for w in self._cm.works)

    def exception(self):
        for w in self._cm.works:
            if w.exception() is not None:
                return w.exception()
        return None

    def __repr__(self) -> str:
        return f"<pending op of {self._cm!r}>"


class _Recorder:
    """Stands in for a group's engine inside the block: records the fusable ops."""

    def __init__(self, cm: CoalescingManager, engine):
        self._cm = cm
        self.engine = engine

    def run(self, op: str, async_op: bool, *args):
        """What the public ops call (:meth:`spmd.backends.base.Engine.run`): the op is
        recorded; a blocking call returns at once (the batch runs when the block ends)."""
        pending = getattr(self, op)(*args)
        return pending if async_op else None

    def all_reduce(self, a, op):
        return self._cm._record("all_reduce", a, None, op)

    def all_gather_into_tensor(self, out, a):
        return self._cm._record("all_gather_into_tensor", out, a, None)

    def reduce_scatter_tensor(self, out, a, op):
        return self._cm._record("reduce_scatter_tensor", out, a, op)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        raise located(ValueError, name, "cannot run inside coalescing_manager(): only "
                      f"{', '.join(_FUSABLE)} are fused there", self._cm.group.context)


class CoalescingManager:
    """The batch of one ``coalescing_manager`` block (torch's ``_CoalescingManager``).

    ``works`` holds the batch's Work once the block has ended (one per dtype for
    reduce_scatter_tensor, one in every other case); ``wait()`` waits for them.
    """

    def __init__(self, group: Any):  # the ProcessGroup (as given, on a non-member)
        self.group = group
        self.works: list[Work] = []
        self._ops: list[tuple] = []
        self._kind: str | None = None
        self._op: ReduceOp | None = None  # the batch's reduction (all_reduce, reduce_scatter)
        self._issued = False

    @property
    def work(self) -> Work | None:
        """The batch's Work (the first, where reduce_scatter_tensor made one per dtype)."""
        return self.works[0] if self.works else None

    def append(self, work: Work) -> None:
        self.works.append(work)

    def wait(self, timeout: Timeout | None = None) -> None:
        """Wait for every Work of the batch."""
        for w in self.works:
            w.wait(timeout)

    def _record(self, kind: str, out, inp, op: ReduceOp | None) -> _Pending:
        if self._kind is None:
            self._kind, self._op = kind, op
        elif kind != self._kind:
            raise located(ValueError, kind, f"cannot join a coalescing_manager() batch of "
                          f"{self._kind}: all ops of a block must be the same collective",
                          self.group.context)
        elif op is not None and (self._op is None or op.name != self._op.name
                                 or op.factor is not self._op.factor):
            raise located(ValueError, kind, f"{op!r} cannot join a batch reduced with "
                          f"{self._op!r}: all ops of a block must use the same ReduceOp",
                          self.group.context)
        self._ops.append((out, inp))
        return _Pending(self)

    def _issue(self, engine) -> None:
        self._issued = True
        if not self._ops:
            return
        if self._kind == "all_reduce":
            self.append(engine.all_reduce_coalesced([o for o, _ in self._ops], self._op))
        elif self._kind == "all_gather_into_tensor":
            self.append(_all_gather(engine, self._ops, self.group.context.size))
        else:
            by_dtype: dict = {}
            for out, inp in self._ops:
                by_dtype.setdefault(inp.dtype, []).append((out, inp))
            for pairs in by_dtype.values():
                self.append(_reduce_scatter(engine, pairs, self._op, self.group.context.size))

    def __repr__(self) -> str:
        state = "issued" if self._issued else "recording"
        return (f"<CoalescingManager {self._kind or 'empty'} x{len(self._ops)} {state} "
                f"group={getattr(self.group, 'name', self.group)}>")


def _all_gather(engine, ops, n: int):
    # Each output viewed as n rows; rank i's input lands in row i of every output.
    lists: list[list] = [[] for _ in range(n)]
    inputs, copies = [], []
    for out, inp in ops:
        target = out if out.flags.c_contiguous else np.empty(out.shape, out.dtype)
        if target is not out:
            copies.append((out, target))
        rows = target.reshape(n, -1)
        for i in range(n):
            lists[i].append(rows[i])
        inputs.append(inp)
    work = engine.all_gather_coalesced(lists, inputs)
    if copies:
        def copy_back() -> None:
            for o, t in copies:
                np.copyto(o, t)
        then(work, copy_back)
    return work


def _reduce_scatter(engine, pairs, op, n: int):
    # Packed so that chunk i of the packed input is chunk i of every input, in order:
    # one reduce-scatter then leaves each output's share contiguous in the result.
    ins = [inp.reshape(n, -1) for _, inp in pairs]
    packed = np.concatenate(ins, axis=1).reshape(-1)
    result = np.empty(packed.size // n, packed.dtype)
    work = engine.reduce_scatter_tensor(result, packed, op)
    outs = [out for out, _ in pairs]

    def unpack():
        pos = 0
        for o in outs:
            np.copyto(o, result[pos:pos + o.size].reshape(o.shape))
            pos += o.size

    then(work, unpack)
    return work


def _device_key(device) -> str:
    if device is None:
        return "cpu"
    name = getattr(device, "type", device)
    return str(name).split(":")[0]


@contextlib.contextmanager
def coalescing_manager(group: GroupArg = None, device: object = None,
                       async_ops: bool = False) -> Iterator[CoalescingManager]:
    """Fuse the collectives issued inside the block into one per bucket (torch's
    ``_coalescing_manager``).

    Inside the block, ``all_reduce``, ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor`` calls on ``group`` are checked and recorded, not started;
    they return None (a placeholder Work with ``async_op=True``), and their arrays
    must not be read or written until the batch completes.  When the block ends the
    batch runs: all-reduces packed per dtype into buckets (``get_bucket_bytes()``),
    all-gathers as one all-gather of their bytes, reduce-scatters as one per dtype.
    All ops of a block must be the same collective (all-reduces with the same
    ReduceOp).  Every rank of the group must issue the same ops in the same order.

    Args:
        group: the group (WORLD if None).
        device: which engine to fuse on ("cpu" if None).
        async_ops: if False the block waits for the batch when it ends; if True it
            returns at once and ``cm.wait()`` (or ``cm.works``) completes it.

    Yields:
        The :class:`~spmd.api.coalescing.CoalescingManager` of the batch.

    Raises:
        ValueError: an op that cannot be fused, or a mix of collectives, inside.
        RuntimeError: a coalescing_manager block is already open on this group.
    """
    pg = resolve(group, "coalescing_manager")
    if pg is None:  # not a member: nothing to fuse, every op inside returns None
        yield CoalescingManager(group)
        return
    key = _device_key(device)
    engine = pg.engines[key]
    if isinstance(engine, _Recorder):
        raise RuntimeError(f"coalescing_manager: a block is already open on group {pg.context.name} "
                           "(they do not nest)")
    cm = CoalescingManager(pg)
    pg.engines[key] = _Recorder(cm, engine)
    try:
        yield cm
    finally:
        pg.engines[key] = engine
    cm._issue(engine)
    if not async_ops:
        cm.wait()
