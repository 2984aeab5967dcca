"""Node-local shared-memory collectives for host arrays, hierarchical across nodes.

Inside a node, ranks exchange data through one MPI-3 shared window per group
(``window.py``) instead of MPI messages, by these algorithms (``algorithms.py``):

- one-shot all_reduce (small and medium arrays): every rank copies its input into its
  slot; every rank reduces all slots, in local-rank order, into its output.
- two-shot all_reduce (large arrays): the array goes through the window in chunks of
  one slot; each rank copies the parts of a chunk other ranks own into its slot, reduces
  the part it owns from every rank's slot, and every rank copies all reduced parts out.
- across nodes: the reduced part is all-reduced by MPI among the ranks with the same
  local rank (one per node) before it is copied out: a hierarchical all_reduce.
- broadcast, all_gather, all_gather_into_tensor, reduce_scatter_tensor and reduce run
  on one node through the same slots.

Inside a node every element is reduced in local-rank order (rank 0's value first),
whichever path and whichever rank computes it, and each reduced element is computed
once and copied, so every rank gets the same bits.  Across nodes the node sums are
combined by MPI's all_reduce, whose result is the same on every rank (MPICH's is; the
MPI standard advises it).  Chunks cycle through a ring of slots, so the window does
not grow with the message.

The MPI engine hands an op to the engine when its size passes the engine's threshold
for that op (the ``*_from`` attributes; the all-gathers also have an upper bound):
sizes where the engine measured faster than the MPI library (see AUTO_FROM).
``SPMD_SHM=0`` turns the engine off, ``SPMD_SHM=force`` uses it at every size.  Where
the window cannot be allocated the group quietly uses MPI; ``spmd info`` says why.

An engine op returns a Work whose test runs the op's next steps: each step either runs
or finds that a peer has not caught up, so waits honour deadlines, ``async_op=True``
returns at once, and the ops of one group run in the order they were started.  An op
moves while its rank starts, tests or waits on engine ops (of any group).  Unlike an
MPI request, it does not move while its rank waits only on MPI requests: a rank that
blocks in a receive whose sender waits in an engine op of theirs must test its engine
Works first.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from spmd.backends.setup import set_up
from spmd.backends.shm.algorithms import SlotRing
from spmd.backends.shm.reduce import Reduction
from spmd.backends.shm.scheduler import Scheduler
from spmd.backends.shm.thresholds import (
    ACROSS_NODES,
    ACROSS_NODES_FORCED,
    AUTO_FROM,
    AUTO_FROM_OVERSUBSCRIBED,
    FORCED,
    NEVER,
    NOTHING,
    ONE_SHOT_READ,
    SHM_ENV,
    SLOT_BYTES,
    SLOT_BYTES_OVERSUBSCRIBED,
    SLOTS,
    Thresholds,
    shm_mode,
    status,
)
from spmd.backends.shm.window import NodeWindow, open_window
from spmd.core import wait as _wait
from spmd.core.arrays import contiguous
from spmd.core.work import Work

__all__ = ["SHM_ENV", "ShmEngine", "shm_engine_beside", "shm_mode", "status"]

# Windows of groups a member of died: never freed (MPI_Win_free would wait for the dead
# member), kept referenced so nothing frees them behind MPI's back.
abandoned_windows: list = []

_U8 = np.dtype(np.uint8)


def shm_engine_beside(mpi_engine) -> ShmEngine | None:
    """The shared-memory engine beside ``mpi_engine`` (its group's MPI engine), or None
    where it cannot help (SPMD_SHM off, or a group of one process in auto mode)."""
    mode = shm_mode()
    if mode == "off" or (mode == "auto" and mpi_engine.size < 2):
        return None
    return ShmEngine(mpi_engine, mode)


def _flat(a: np.ndarray) -> np.ndarray:
    """A contiguous 1-D array with ``a``'s items: a view when ``a`` is contiguous."""
    return contiguous(a).reshape(-1)


class ShmEngine:
    """One group's shared-memory engine: its window (made on first use) and op queue.

    Every rank of the group makes the same calls, so all of them take the same path
    for every op; the window is set up collectively by the first op that needs it.
    """

    # Thresholds (bytes, see Thresholds): an op of this size or more runs here.  Set per
    # mode at construction, raised by a set-up that finds the engine cannot help.  Plain
    # attributes: the blocking and compiled call paths read them on every call.
    all_reduce_from: int
    reduce_from: int
    reduce_scatter_from: int
    broadcast_from: int
    all_gather_from: int
    all_gather_to: int

    def __init__(self, mpi_engine, mode: str):
        # Told the new thresholds whenever they change: the compiled call path keeps a copy.
        self.on_thresholds: list[Callable[[Thresholds], None]] = []
        self._mpi = mpi_engine
        self._group = mpi_engine.group
        self.mode = mode
        self.slot_bytes = SLOT_BYTES_OVERSUBSCRIBED if _wait.oversubscribed else SLOT_BYTES
        self.nslots = SLOTS
        self.one_shot_max: int | None = None  # bytes; ONE_SHOT_READ / local ranks unless set
        if mode == "force":
            self._take(FORCED)
        else:
            self._take(AUTO_FROM_OVERSUBSCRIBED if _wait.oversubscribed else AUTO_FROM)
        self._win: NodeWindow | None = None
        self._reason: str | None = None          # why the engine is unavailable, once known
        self._scheduler = Scheduler(self._group)
        self._ring = SlotRing(self._copy_in)
        self._reductions: dict = {}  # plan -> Reduction, for plans without a factor
        # stream(dst, src): a copy into the window past the cache (the compiled
        # extension's, pushed by the host engine when it is on), else None.
        self.stream: Callable[[np.ndarray, np.ndarray], None] | None = None

    def _take(self, sizes: Thresholds) -> None:
        self.all_reduce_from = sizes.all_reduce_from
        self.reduce_from = sizes.reduce_from
        self.reduce_scatter_from = sizes.reduce_scatter_from
        self.broadcast_from = sizes.broadcast_from
        self.all_gather_from = sizes.all_gather_from
        self.all_gather_to = sizes.all_gather_to
        for listener in self.on_thresholds:
            listener(sizes)

    def thresholds(self) -> Thresholds:
        """The sizes from which this engine takes each op, as they are now."""
        return Thresholds(self.all_reduce_from, self.reduce_from, self.reduce_scatter_from,
                          self.broadcast_from, self.all_gather_from, self.all_gather_to)

    def gathers(self, nbytes: int) -> bool:
        """True if an all-gather with ``nbytes`` of output runs here."""
        return self.all_gather_from <= nbytes < self.all_gather_to

    # -- set-up --------------------------------------------------------------------

    def _takes(self, op: str, nbytes: int) -> bool:
        """True if ``op`` of ``nbytes`` runs here (asked again after the set-up)."""
        if op == "all_reduce":
            return nbytes >= self.all_reduce_from
        if op == "reduce":
            return nbytes >= self.reduce_from
        if op == "reduce_scatter_tensor":
            return nbytes >= self.reduce_scatter_from
        if op == "broadcast":
            return nbytes >= self.broadcast_from
        return self.gathers(nbytes)  # all_gather, all_gather_into_tensor

    def _setup(self, op: str) -> None:
        """Make the window: the first op that may run here (``op``) does it, on every rank.

        Like NCCL's lazily made communicators, that op waits for every rank of the group
        to reach it, even when started with ``async_op=True``.  The window is made over a
        duplicate of the group's communicator, under the group's timeout
        (:func:`spmd.backends.setup.set_up`), so a rank whose peers never come, or gave
        up before it came, gets an error instead of a hang.  Doing it when the op is
        called, not later in its steps, keeps an op the window turns out not to take in
        its place among the group's MPI ops.
        """
        if self.nslots < 3:  # see the release marks of the algorithms
            raise ValueError(f"the engine needs 3 or more slots, got {self.nslots}")
        group = self._group

        def make_window() -> tuple[NodeWindow | None, str]:
            comm = group.comm.Dup()
            try:
                return open_window(comm, self.slot_bytes, self.nslots)
            finally:
                comm.Free()

        win, reason = set_up(group, op, "the shared-memory engine", make_window)
        if win is None:
            self._reason = reason
            self._take(NOTHING)
            return
        self._win = self._scheduler.window = win
        self._ring.attach(win)
        if self.one_shot_max is None:
            self.one_shot_max = ONE_SHOT_READ // win.local_size
        if self.mode == "auto" and win.local_size < 2:
            self._reason = "no two ranks of the group share a node"
            self._take(NOTHING)
        elif win.num_nodes > 1:
            self._take(ACROSS_NODES_FORCED if self.mode == "force" else ACROSS_NODES)

    def abandon(self) -> None:
        """Drop the window without freeing it (MPI_Win_free waits for every rank of the
        node, and one may be dead): its memory goes with the process."""
        win, self._win = self._win, None
        self._scheduler.clear()
        if win is not None:
            abandoned_windows.append(win)

    def shutdown(self) -> None:
        """Free the window (every rank of the group calls it, when the group is destroyed).

        MPI_Win_free waits for every rank of the node.  Where not every rank comes within
        the group's timeout (10 s at most once the group broke on a timeout), or MPI
        reports one dead meanwhile (ULFM), the window is left unfreed instead of hanging
        the caller or failing the teardown.
        """
        win, self._win = self._win, None
        self._scheduler.clear()
        if win is None:
            return
        if self._group.failed is not None:
            # A member died: MPI windows are not fault tolerant, and MPI_Win_free would
            # wait for it forever.
            abandoned_windows.append(win)
            return
        wait = self._group.timeout
        if self._group.error is not None:  # peers may be gone
            wait = min(wait, 10.0)
        if win.meet(wait):
            win.free()
        else:   # a member late past the wait, or dead meanwhile: as above
            abandoned_windows.append(win)

    def describe(self) -> str:
        """One line for ``spmd info``: on/off, layout, thresholds, or why it is unavailable.
        Sets the window up: every rank of the group must call it."""
        if self._win is None and self._reason is None:
            self._setup("spmd info")
        if self._win is None or self.all_reduce_from >= NEVER:
            return f"unavailable, MPI is used: {self._reason}"
        w = self._win
        assert self.one_shot_max is not None  # the set-up that made the window set it
        where = (f"{w.local_size} rank(s) per node" if w.num_nodes == 1 else
                 f"{w.num_nodes} nodes x {w.local_size} ranks, hierarchical all_reduce")
        return (f"{self.mode}: {where}; window {self.nslots} x {self.slot_bytes >> 10} KiB "
                f"per rank; all_reduce from {self.all_reduce_from} B, one-shot up to "
                f"{min(self.one_shot_max, self.slot_bytes)} B")

    # -- starting ops ----------------------------------------------------------------

    def _start(self, nbytes: int, steps, fallback, op: str, outputs, keep) -> Work:
        """Queue an op: its ``steps`` (a generator), or run ``fallback()`` (the MPI
        engine's op) if the window's set-up shows that the engine does not take it."""
        self._scheduler.check(op)
        if self._win is None and self._reason is None:
            self._setup(op)
            if not self._takes(op, nbytes):
                # The set-up raised the threshold (the group spans nodes) or found no window.
                steps.close()
                return fallback()
        return self._scheduler.start(steps, op, outputs, keep)

    def _window(self) -> NodeWindow:
        """The window, for the steps of ops: they run only once the set-up has made it."""
        win = self._win
        assert win is not None, "the shared-memory engine's steps run without its window"
        return win

    def _reduction(self, plan, op) -> Reduction:
        if plan.premul:  # the factor is the op's: read it at every call
            return Reduction(plan, op, self._group.size)
        red = self._reductions.get(plan)
        if red is None:
            red = self._reductions[plan] = Reduction(plan, op, self._group.size)
        return red

    def _copy_in(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy ``src`` into this rank's slot (``dst``, same shape): streamed past the
        cache where ``stream`` is set and both are contiguous (the peers read the lines
        next; _fastcall.c's stream_copy says what that saves), else numpy's copy."""
        if self.stream is not None and src.flags.c_contiguous and dst.flags.c_contiguous:
            self.stream(dst, src)
        else:
            np.copyto(dst, src)

    # -- ops (same arguments as the MPI engine's; arguments already validated) ------

    def all_reduce(self, a, op):
        mpi = self._mpi
        plan = mpi.reduction_plan(a.dtype, op, "all_reduce")
        steps = self._reduce_steps(a, plan.view, self._reduction(plan, op), None)
        return self._start(a.nbytes, steps,
                           lambda: mpi.all_reduce(a, op), "all_reduce", [a], a)

    def all_reduce_coalesced(self, pieces, op):
        """All-reduce the arrays of ``pieces`` (a ``_fastcall.Pieces`` or
        ``packing.ArrayPieces``: one dtype, one fusion bucket) as one array."""
        mpi = self._mpi
        dt = pieces.dtype
        plan = mpi.reduction_plan(dt, op, "all_reduce_coalesced")
        steps = self._fused_steps(pieces, plan.view, self._reduction(plan, op))
        return self._start(pieces.nbytes, steps,
                           lambda: mpi.all_reduce_coalesced(pieces.arrays, op),
                           "all_reduce", pieces.arrays, pieces)

    def reduce(self, a, root, op):
        mpi = self._mpi
        plan = mpi.reduction_plan(a.dtype, op, "reduce")
        steps = self._reduce_steps(a, plan.view, self._reduction(plan, op), root)
        return self._start(a.nbytes, steps,
                           lambda: mpi.reduce(a, root, op), "reduce", [a], a)

    def reduce_scatter_tensor(self, out, a, op):
        mpi = self._mpi
        plan = mpi.reduction_plan(a.dtype, op, "reduce_scatter_tensor")
        steps = self._reduce_scatter_steps(out, a, plan.view, self._reduction(plan, op))
        return self._start(a.nbytes, steps,
                           lambda: mpi.reduce_scatter_tensor(out, a, op),
                           "reduce_scatter_tensor", [out], (a, out))

    def broadcast(self, a, root):
        return self._start(a.nbytes, self._broadcast_steps(a, root),
                           lambda: self._mpi.broadcast(a, root), "broadcast", [a], a)

    def all_gather_into_tensor(self, out, a):
        if out.flags.c_contiguous:
            flat = out.reshape(-1)
            steps = self._gather_steps(a, [flat[j * a.size:(j + 1) * a.size]
                                           for j in range(self._group.size)])
        else:
            steps = self._gather_steps(a, None, out)
        return self._start(out.nbytes, steps,
                           lambda: self._mpi.all_gather_into_tensor(out, a),
                           "all_gather_into_tensor", [out], (a, out))

    def all_gather(self, outputs, a):
        steps = self._gather_steps(a, list(outputs))
        return self._start(sum(o.nbytes for o in outputs), steps,
                           lambda: self._mpi.all_gather(outputs, a), "all_gather",
                           list(outputs), (a, outputs))

    # -- what each op does once the window is there ---------------------------------

    def _reduce_steps(self, a, view, red: Reduction, root):
        """all_reduce (``root`` None) or reduce: one-shot when it fits, else two-shot."""
        arr = a if view is None else a.view(view)
        one_shot_max = self.one_shot_max
        assert one_shot_max is not None  # set with the window, before any op's steps run
        if self._window().num_nodes == 1 and a.nbytes <= min(one_shot_max, self.slot_bytes):
            yield from self._ring.one_shot(arr, red, root)
            return
        flat = _flat(arr)
        yield from self._ring.two_shot(flat, red, root)
        if not arr.flags.c_contiguous and (root is None or root == self._group.rank):
            np.copyto(arr, flat.reshape(arr.shape))

    def _fused_steps(self, pieces, view, red: Reduction):
        """all_reduce_coalesced: one-shot with the arrays gathered straight into the slot
        and summed straight into the arrays where they fit; else all_reduce's steps on a
        packed copy."""
        count = pieces.nbytes // pieces.dtype.itemsize
        if view is None and self._window().num_nodes == 1 and \
                pieces.nbytes <= min(self.one_shot_max or 0, self.slot_bytes):
            yield from self._ring.one_shot_pieces(pieces, count, red)
            return
        flat = np.empty(count, pieces.dtype)
        pieces.gather(flat)
        yield from self._reduce_steps(flat, view, red, None)
        pieces.scatter(flat)

    def _reduce_scatter_steps(self, out, a, view, red: Reduction):
        fin = _flat(a if view is None else a.view(view))
        o = out if view is None else out.view(view)
        fout = o.reshape(-1) if o.flags.c_contiguous else np.empty(o.size, o.dtype)
        yield from self._ring.reduce_scatter(fin, fout, red)
        if not o.flags.c_contiguous:
            np.copyto(o, fout.reshape(o.shape))

    def _broadcast_steps(self, a, root):
        staged = not a.flags.c_contiguous
        flat = np.ascontiguousarray(a) if staged else a
        yield from self._ring.broadcast(flat.reshape(-1).view(_U8), root)
        if staged and root != self._group.rank:
            np.copyto(a, flat)

    def _gather_steps(self, a, outs, whole=None):
        """All-gather into ``outs`` (arrays, one per rank), or, when ``outs`` is None, into
        ``whole`` (an output that is not contiguous) through a contiguous copy."""
        if outs is None:
            buf = np.empty(whole.size, whole.dtype)
            n = whole.size // self._group.size
            yield from self._gather_steps(a, [buf[j * n:(j + 1) * n]
                                              for j in range(self._group.size)])
            np.copyto(whole, buf.reshape(whole.shape))
            return
        flats = [o.reshape(-1) if o.flags.c_contiguous else np.empty(o.size, o.dtype)
                 for o in outs]
        yield from self._ring.all_gather(_flat(a).view(_U8), [f.view(_U8) for f in flats])
        for o, f in zip(outs, flats, strict=True):
            if not o.flags.c_contiguous:
                np.copyto(o, f.reshape(o.shape))
