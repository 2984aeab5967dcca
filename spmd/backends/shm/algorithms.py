"""The shared-memory engine's algorithms: how an op's data moves through the window's slots.

Each algorithm is a generator over one group's ring of slots (``SlotRing``): it yields
what its next step waits for (a slot free again, the peers' publish, an MPI request),
and the engine's scheduler runs the steps (``spmd.backends.shm.scheduler``).  One-shot
all_reduce copies the input into this rank's slot and reduces every slot; two-shot goes
chunk by chunk, each rank reducing the part it owns (all-reduced across nodes by MPI)
and every rank copying the reduced parts out; reduce_scatter, broadcast and all_gather
go through the same slots.  Which algorithm an op takes, and how its arrays are staged,
is the engine's (``spmd.backends.shm.engine``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from spmd.backends.shm.reduce import Reduction, accumulate, finalize
from spmd.backends.shm.thresholds import ALIGN
from spmd.backends.shm.window import NodeWindow

__all__: list[str] = []


def _cuts(count: int, parts: int, step: int) -> list[int]:
    """Boundaries of ``parts`` near-equal parts of ``count`` items, on multiples of ``step``."""
    units = -(-count // step)
    base, extra = divmod(units, parts)
    cuts, pos = [0], 0
    for j in range(parts):
        pos += base + (j < extra)
        cuts.append(min(count, pos * step))
    return cuts


def _same_start(x: np.ndarray, y: np.ndarray) -> bool:
    return x.__array_interface__["data"][0] == y.__array_interface__["data"][0]


class Chunk:
    """One chunk of a two-shot all-reduce between its reduction and its copy-out."""

    __slots__ = ("lo", "cuts", "slot", "acc", "dst", "request")

    def __init__(self, lo: int, cuts: list[int], slot: int, acc, dst, request):
        self.lo = lo            # its first item in the flat array
        self.cuts = cuts        # where each local rank's part starts
        self.slot = slot        # the slot it went through
        self.acc = acc          # this rank's reduced part (the accumulator)
        self.dst = dst          # this rank's part of the slot, where the result goes
        self.request = request  # the cross-node all-reduce of ``acc``, or None


class SlotRing:
    """One group's ring of slots in its window, and the algorithms that use it.

    Every rank of the group takes the slots in the same order, so the k-th chunk of
    every rank's op goes through the same slot.
    """

    # Every algorithm waits once per chunk.  A slot is free again once every peer has
    # published the step after the one in which it last read the slot: its release mark
    # is this rank's next publish (seq + 1), so freeing costs no step of its own.  With
    # three or more slots, the chunk that reuses a slot comes after that publish.

    __slots__ = ("win", "slot_bytes", "nslots", "next_slot", "release", "copy_in")

    def __init__(self, copy_in: Callable[[np.ndarray, np.ndarray], None]):
        self.win: NodeWindow | None = None
        self.slot_bytes = 0
        self.nslots = 0
        self.next_slot = 0
        self.release: list[int] = []  # per slot: the step count after which it may be rewritten
        self.copy_in = copy_in  # (dst, src): a copy into this rank's slot

    def attach(self, win: NodeWindow) -> None:
        """Run the algorithms through ``win`` (its slots all free)."""
        self.win = win
        self.slot_bytes = win.slot_bytes
        self.nslots = win.nslots
        self.release = [0] * win.nslots

    def window(self) -> NodeWindow:
        """The window: the algorithms run only once the engine's set-up has made it."""
        win = self.win
        assert win is not None, "the shared-memory engine's steps run without its window"
        return win

    def slot(self) -> tuple[int, int]:
        """The next slot of the ring, and the step count after which it may be rewritten."""
        k = self.next_slot % self.nslots
        self.next_slot += 1
        return k, self.release[k]

    # Every algorithm waits once per chunk.  A slot is free again once every peer has
    # published the step after the one in which it last read the slot: its release mark
    # is this rank's next publish (seq + 1), so freeing costs no step of its own.  With
    # three or more slots, the chunk that reuses a slot comes after that publish.

    def one_shot(self, a, red: Reduction, root):
        """Every rank (or only ``root``) reduces every rank's copy of ``a`` (one slot)."""
        w = self.window()
        me, q = w.local_rank, w.local_size
        k, free_after = self.slot()
        yield free_after
        dt, n = a.dtype, a.size
        if a.flags.c_contiguous:
            a = a.reshape(-1)
            srcs = [w.view(i, k, dt, n) for i in range(q)]
        else:
            srcs = [w.view(i, k, dt, n).reshape(a.shape) for i in range(q)]
        self.copy_in(srcs[me], a)
        yield w.publish()
        if root is None or me == root:
            if red.direct:
                accumulate(red, a, srcs, None)
            else:
                acc, tmp = red.scratch(n, dt)
                acc = a if acc is None else acc.reshape(a.shape)
                accumulate(red, acc, srcs, None if tmp is None else tmp.reshape(a.shape))
                finalize(red, acc, a)
        self.release[k] = w.seq + 1

    def one_shot_pieces(self, pieces, n: int, red: Reduction):
        """``one_shot`` of all_reduce_coalesced: the same steps, the arrays copied into
        the slot and the result into the arrays with no packed copy between."""
        w = self.window()
        k, free_after = self.slot()
        yield free_after
        raw = w.by_slot[k]
        pieces.stream_into(raw[w.local_rank])
        yield w.publish()
        if not (red.direct and red.mpi_op == MPI.SUM and pieces.sum_from(raw)):
            dt = pieces.dtype
            srcs = [w.view(i, k, dt, n) for i in range(w.local_size)]
            acc, tmp = red.scratch(n, dt)
            out = np.empty(n, dt)
            acc = out if acc is None else acc
            accumulate(red, acc, srcs, tmp)
            finalize(red, acc, out)
            pieces.scatter(out)
        self.release[k] = w.seq + 1

    def two_shot(self, flat, red: Reduction, root):
        """Reduce-scatter through the slots (all-reduced across nodes by MPI), then every
        rank (or only ``root``) copies the reduced parts out; software-pipelined, so one
        wait covers chunk i's copy-in and chunk i-1's reduction:

            copy-in(i) | finish(i-1) | publish, wait | copy-out(i-1) | reduce(i)
        """
        w = self.window()
        me, q, cross = w.local_rank, w.local_size, w.cross
        dt = flat.dtype
        per = self.slot_bytes // dt.itemsize
        step = max(1, ALIGN // dt.itemsize)
        part = -(-per // (q * step)) * step
        # Two accumulators: chunk i-1's may still be in MPI's hands while chunk i reduces.
        acc0, tmp = red.scratch(part, dt)
        accs = None if acc0 is None else (acc0, np.empty_like(acc0))  # even, odd chunks
        copy_out = root is None or me == root
        prev: Chunk | None = None  # chunk i-1, finished while chunk i is copied in
        for c, lo in enumerate(range(0, flat.size, per)):
            n = min(per, flat.size - lo)
            cut = _cuts(n, q, step)
            k, free_after = self.slot()
            yield free_after
            mine = w.view(me, k, dt, n)
            for j in range(q):
                if j != me:
                    self.copy_in(mine[cut[j]:cut[j + 1]], flat[lo + cut[j]:lo + cut[j + 1]])
            if prev is not None and cross is not None:
                yield prev.request
                finalize(red, prev.acc, prev.dst)
            yield w.publish()
            if prev is not None:
                if copy_out:
                    self._copy_out(flat, prev)
                self.release[prev.slot] = w.seq + 1
            s0, s1 = cut[me], cut[me + 1]
            srcs = [flat[lo + s0:lo + s1] if i == me else w.view(i, k, dt, n)[s0:s1]
                    for i in range(q)]
            dst = mine[s0:s1]
            acc = dst if accs is None else accs[c & 1][:s1 - s0]
            accumulate(red, acc, srcs, None if tmp is None else tmp[:s1 - s0])
            req = None
            if cross is not None:
                req = cross.Iallreduce(MPI.IN_PLACE, acc, red.mpi_op)
            else:
                finalize(red, acc, dst)
            prev = Chunk(lo, cut, k, acc, dst, req)
        if prev is not None:
            if cross is not None:
                yield prev.request
                finalize(red, prev.acc, prev.dst)
            yield w.publish()
            if copy_out:
                self._copy_out(flat, prev)
            self.release[prev.slot] = w.seq + 1

    def _copy_out(self, flat, chunk: Chunk) -> None:
        """Copy every rank's reduced part of a chunk from its slot into ``flat``."""
        lo, cut, k = chunk.lo, chunk.cuts, chunk.slot
        w = self.window()
        for j in range(w.local_size):
            flat[lo + cut[j]:lo + cut[j + 1]] = w.view(j, k, flat.dtype, cut[-1])[cut[j]:cut[j + 1]]

    def reduce_scatter(self, fin, fout, red: Reduction):
        """Chunk by chunk: each rank copies the blocks others own into its slot and
        reduces its own block from every slot into ``fout``."""
        w = self.window()
        me, q = w.local_rank, w.local_size
        dt, m = fin.dtype, fout.size
        per = max(1, self.slot_bytes // dt.itemsize // q)
        # An output inside the input (in place) would be overwritten before it is read.
        keep_own = np.may_share_memory(fin, fout)
        acc_buf, tmp_buf = red.scratch(min(per, m), dt)
        for lo in range(0, m, per):
            n = min(per, m - lo)
            k, free_after = self.slot()
            yield free_after
            mine = w.view(me, k, dt, q * n)
            for j in range(q):
                if j != me or keep_own:
                    self.copy_in(mine[j * n:(j + 1) * n], fin[j * m + lo:j * m + lo + n])
            yield w.publish()
            srcs = [fin[me * m + lo:me * m + lo + n] if i == me and not keep_own
                    else w.view(i, k, dt, q * n)[me * n:(me + 1) * n] for i in range(q)]
            dst = fout[lo:lo + n]
            acc = dst if acc_buf is None else acc_buf[:n]
            accumulate(red, acc, srcs, None if tmp_buf is None else tmp_buf[:n])
            finalize(red, acc, dst)
            self.release[k] = w.seq + 1

    def broadcast(self, flat, root):
        w = self.window()
        me, size = w.local_rank, self.slot_bytes
        for lo in range(0, flat.size, size):
            n = min(size, flat.size - lo)
            k, free_after = self.slot()
            yield free_after
            if me == root:
                self.copy_in(w.slots[me][k][:n], flat[lo:lo + n])
            yield w.publish()
            if me != root:
                flat[lo:lo + n] = w.slots[root][k][:n]
            self.release[k] = w.seq + 1

    def all_gather(self, fin, fouts: list):
        """Rank j's bytes land in ``fouts[j]`` on every rank (sizes may differ by rank)."""
        w = self.window()
        me, size = w.local_rank, self.slot_bytes
        own = fouts[me]
        copy_own = own.size > 0 and not _same_start(fin, own)  # in place: already there
        longest = max(f.size for f in fouts)
        for lo in range(0, longest, size):
            k, free_after = self.slot()
            yield free_after
            n = max(0, min(size, fin.size - lo))
            self.copy_in(w.slots[me][k][:n], fin[lo:lo + n])
            ready = w.publish()
            if copy_own:
                own[lo:lo + n] = fin[lo:lo + n]
            yield ready
            for j, f in enumerate(fouts):
                if j != me and f.size > lo:
                    n = min(size, f.size - lo)
                    f[lo:lo + n] = w.slots[j][k][:n]
            self.release[k] = w.seq + 1
