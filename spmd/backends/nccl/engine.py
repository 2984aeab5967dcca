"""NCCL for GPU arrays, through CuPy's ``cupy.cuda.nccl``, bootstrapped over MPI.

A group's NCCL communicator is created at the group's first GPU operation (or at
``init_process_group(device_id=...)``): group rank 0 asks NCCL for a unique id, the id
travels over the group's MPI communicator (or the init store), and every member calls
``NcclCommunicator(size, id, rank)``.  Groups split from a group that already has a
communicator get theirs from ``ncclCommSplit`` where CuPy (>= 14) and NCCL (>= 2.18)
have it.

Streams: each communicator has its own CUDA stream.  An operation started with
``async_op=True`` makes that stream wait for an event recorded on the caller's current
stream (so the inputs are ready), enqueues the NCCL calls (and any packing, scaling or
copying back) on it, and records an end event.  ``Work.wait()`` makes the caller's
current stream wait for the end event without blocking the host, as in c10d;
``Work.synchronize()`` blocks the host.  A blocking call enqueues on the caller's current
stream itself, as c10d does for ``async_op=False`` (NCCL serialises the kernels of one
communicator across the streams they are launched on: its launches wait on the
communicator's internal stream).  The arrays of an operation are kept alive
until its end event has passed.

Per call, only what the call itself needs is done: the reduction plan of a dtype and
reduce op is resolved once, the stream and the event it waits on are made once, end
events are reused once their operation has passed.  The commonest call, a blocking
all_reduce of a contiguous array whose plan is resolved, goes straight to
``Communicator.all_reduce_here``: one NCCL call on the caller's stream and its end event,
with no Launch and no Work.

What NCCL cannot do raises TypeError before anything is enqueued (say so in the docs):
bitwise reductions, reductions of int16/uint16 (NCCL has no such types), MIN/MAX/
PRODUCT of complex arrays (they travel as pairs of reals).  Data movement works for
every dtype (bytes are bytes).  Use ``backend="cpu:mpi,cuda:mpi"`` for those.
"""

from __future__ import annotations

import numpy as np

from spmd.backends.base import Engine, P2PItem, reraise
from spmd.backends.nccl.buffers import bytes_into, copy_into, flat_bytes, typed
from spmd.backends.nccl.communicator import Communicator, NcclWork
from spmd.backends.nccl.creation import NOCOLOR
from spmd.backends.nccl.plans import (
    INT_MAX,
    NCCL_TYPES,
    PLANS,
    USE_MPI,
    byte_units,
    cupy_count_is_int,
    plan_for,
    runtime_plan,
    runtime_version,
)
from spmd.backends.nccl.uniqueid import uid_for_cupy, uid_to_bytes
from spmd.backends.reduction import AVERAGE, checked_plan, premul_factor
from spmd.backends.registry import Backend as BackendName
from spmd.core import cuda as _gpu
from spmd.core.arrays import contiguous
from spmd.core.context import GroupContext
from spmd.core.errors import located
from spmd.core.ops import ReduceOp

__all__ = ["NCCL_TYPES", "NCCLEngine", "NcclWork", "plan_for", "uid_for_cupy", "uid_to_bytes"]


class NCCLEngine(Engine):
    """NCCL collectives and point-to-point operations on cupy arrays: what each operation
    enqueues.  Where and when it runs (the communicator, its stream, the operations in
    flight, the abort) is ``self.communicator``'s."""

    name = "nccl"

    def __init__(self, group: GroupContext):
        super().__init__(group)
        cp = _gpu.need_cupy("spmd", "the NCCL backend", group)
        nccl = _gpu.nccl_or_none()
        if nccl is None:
            raise RuntimeError(f"the NCCL backend cannot run here: {_gpu.nccl_problem()} "
                               f"[rank {group.rank}, group {group.name}]")
        self._cp = cp
        self._nccl = nccl
        self.communicator = Communicator(group, cp, nccl)
        self._resolved: dict = {}
        # (dtype, id of a ReduceOp member) -> (NCCL datatype, NCCL op, count factor) where
        # NCCL reduces a contiguous array alone, in place: all_reduce's plan, checked once
        # per pair (PREMUL_SUM's ops are made per factor, and never members).
        self._direct: dict = {}

    def run(self, op: str, async_op: bool, *args):
        """A blocking call enqueues on the caller's current stream (c10d's NCCL backend
        does so for ``async_op=False``): the caller's later work is ordered after it
        without an event between two streams, and its Work has nothing left to wait for
        but NCCL's errors.  A call that may be waited for later goes on the
        communicator's stream."""
        try:
            if async_op:
                return getattr(self, op)(*args)
            if op == "all_reduce":
                # The common kind (a contiguous array, a plan an earlier call resolved):
                # NCCL's call alone, left in flight without a Work where the communicator
                # can (Communicator.all_reduce_here).
                a, rop = args
                direct = self._direct.get((a.dtype, id(rop)))
                if direct is not None and a.flags.c_contiguous and \
                        self.communicator.all_reduce_here(a, a.size * direct[2], direct[0],
                                                          direct[1]):
                    return None
            caller = self.communicator.caller
            caller.on = True
            try:
                getattr(self, op)(*args).wait()
            finally:
                caller.on = False
            return None
        except Exception as exc:
            reraise(self, exc, op)

    # -- the communicator's life ----------------------------------------------------------

    def connect(self, op: str = "connect"):
        """Create the NCCL communicator now (collective over the group); return it."""
        return self.communicator.connect(op)

    def on_split(self, child: GroupContext | None, color: int, key: int) -> None:
        """After ``Comm.Split`` of a group whose NCCL communicator exists, split that too;
        the child's communicator waits in ``child.inherited`` for its first operation
        when the child's GPU backend is NCCL."""
        wanted = child is not None and color >= 0
        new = self.communicator.split(color if wanted else NOCOLOR, key)
        if new is None:
            return
        if child is not None and \
                BackendName.device_map(child.backend_name).get("cuda") in ("nccl", "undefined"):
            child.inherited["cuda"] = new
        else:
            new.destroy()

    def can_split(self) -> bool:
        return self.communicator.can_split()

    def shutdown(self) -> None:
        if self.group.failed is not None:   # a member died: its kernels would never end
            self.abort()
        self.communicator.shutdown()

    def abort(self) -> None:
        why = ("shrink_group replaced it, or a rank died elsewhere" if self.group.failed is None
               else f"ranks {list(self.group.failed)} died")
        self.communicator.abort(f"the group was aborted ({why})")
        self.communicator.shutdown()

    def _plan(self, dtype, op, opname: str):
        """(plan, NCCL datatype, NCCL op, divide after) for a reduction, or raise."""
        plan = checked_plan(PLANS, dtype, op, opname, self.group)
        got = self._resolved.get(id(plan))
        if got is None:
            nccl = self._nccl
            ntype = getattr(nccl, plan.nccl_type, None)
            if ntype is None:
                raise located(TypeError, opname, f"this NCCL build has no {plan.nccl_type} "
                              f"for {dtype} arrays; {USE_MPI}", self.group)
            native_avg, refused = runtime_plan(plan, runtime_version(nccl))
            if refused is not None:
                raise located(TypeError, opname, f"{dtype} arrays: {refused}", self.group)
            nop, divide = getattr(nccl, plan.nccl_op), plan.avg
            if native_avg:
                nop, divide = nccl.NCCL_AVG, None
            got = self._resolved[id(plan)] = (plan, ntype, nop, divide)
        return got

    def _scaled(self, a, plan, op):
        """The buffer NCCL reduces: ``a`` itself when it can, else a contiguous copy
        (scaled by the PREMUL_SUM factor when there is one)."""
        cp = self._cp
        if plan.premul:
            buf = cp.array(a, order="C")
            cp.multiply(buf, premul_factor(op), out=buf, casting="unsafe")
            return buf
        return contiguous(a, cp)

    def _divide(self, buf, divide) -> None:
        if divide is None or not buf.size:
            return
        AVERAGE[divide](buf, self.group.size)

    # -- reductions --------------------------------------------------------------------

    def _direct_all_reduce(self, a, direct):
        """Launch the common all_reduce: NCCL alone, in place, with the plan (``direct``)
        an earlier call resolved."""
        t, o, factor = direct
        launch = self.communicator.launch("all_reduce", kernels=False)
        with launch as (comm, s):
            if a.size:
                ptr = a.data.ptr
                comm.allReduce(ptr, ptr, a.size * factor, t, o, s)
        return launch

    def all_reduce(self, a, op):
        direct = self._direct.get((a.dtype, id(op)))
        if direct is not None and a.flags.c_contiguous:
            return self.communicator.started(self._direct_all_reduce(a, direct), [a], a)
        plan, t, o, divide = self._plan(a.dtype, op, "all_reduce")
        if divide is None and not plan.premul and op is getattr(ReduceOp, op.name):
            # (a member of ReduceOp lives for good: its id stays its own)
            self._direct[(a.dtype, id(op))] = t, o, plan.count_factor
        simple = divide is None and not plan.premul and a.flags.c_contiguous  # NCCL alone
        nc = self.communicator
        launch = nc.launch("all_reduce", kernels=not simple)
        with launch as (comm, s):
            buf = self._scaled(a, plan, op)
            if buf.size:
                comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size * plan.count_factor, t, o, s)
            self._divide(buf, divide)
            copy_into(self._cp, a, buf)
        return nc.started(launch, [a], (a, buf))

    def all_reduce_coalesced(self, tensors, op):
        cp, nc = self._cp, self.communicator
        by_dtype: dict = {}
        for x in tensors:
            by_dtype.setdefault(x.dtype, []).append(x)
        plans = {dt: self._plan(dt, op, "all_reduce_coalesced") for dt in by_dtype}
        kept = []
        launch = nc.launch("all_reduce_coalesced")
        with launch as (comm, s):
            for dt, arrays in by_dtype.items():
                plan, t, o, divide = plans[dt]
                buf = cp.concatenate([flat_bytes(cp, x) for x in arrays]).view(dt)
                if plan.premul:
                    cp.multiply(buf, premul_factor(op), out=buf, casting="unsafe")
                if buf.size:
                    comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size * plan.count_factor,
                                   t, o, s)
                self._divide(buf, divide)
                pos = 0
                for x in arrays:
                    copy_into(cp, x, buf[pos:pos + x.size])
                    pos += x.size
                kept.append(buf)
        return nc.started(launch, list(tensors), (list(tensors), kept))

    def reduce(self, a, root, op):
        plan, t, o, divide = self._plan(a.dtype, op, "reduce")
        nc = self.communicator
        launch = nc.launch("reduce")
        with launch as (comm, s):
            buf = self._scaled(a, plan, op)
            if buf.size:
                comm.reduce(buf.data.ptr, buf.data.ptr, buf.size * plan.count_factor, t, o,
                            root, s)
            if self.group.rank == root:
                self._divide(buf, divide)
                copy_into(self._cp, a, buf)
        return nc.started(launch, [a], (a, buf))

    def reduce_scatter_tensor(self, out, a, op):
        plan, t, o, divide = self._plan(a.dtype, op, "reduce_scatter_tensor")
        cp, nc = self._cp, self.communicator
        launch = nc.launch("reduce_scatter_tensor")
        with launch as (comm, s):
            buf = self._scaled(a, plan, op)
            rbuf = out if out.flags.c_contiguous else cp.empty(out.shape, out.dtype)
            if out.size:
                comm.reduceScatter(buf.data.ptr, rbuf.data.ptr, out.size * plan.count_factor,
                                   t, o, s)
            self._divide(rbuf, divide)
            copy_into(cp, out, rbuf)
        return nc.started(launch, [out], (out, a, buf, rbuf))

    def reduce_scatter(self, out, inputs, op):
        plan, t, o, divide = self._plan(out.dtype, op, "reduce_scatter")
        cp, nc, me = self._cp, self.communicator, self.group.rank
        sizes = [x.size for x in inputs]
        launch = nc.launch("reduce_scatter")
        with launch as (comm, s):
            rbuf = cp.empty(out.nbytes, np.uint8).view(out.dtype)
            if sizes.count(sizes[0]) == len(sizes):
                buf = cp.concatenate([flat_bytes(cp, x) for x in inputs]).view(out.dtype)
                if plan.premul:
                    cp.multiply(buf, premul_factor(op), out=buf, casting="unsafe")
                if out.size:
                    comm.reduceScatter(buf.data.ptr, rbuf.data.ptr,
                                       out.size * plan.count_factor, t, o, s)
                kept = [buf]
            else:  # uneven: one reduce per destination, launched together
                kept = [self._scaled(x, plan, op) for x in inputs]
                with nc.grouped():
                    for r, buf in enumerate(kept):
                        if buf.size:
                            dst = rbuf if r == me else buf
                            comm.reduce(buf.data.ptr, dst.data.ptr, buf.size * plan.count_factor,
                                        t, o, r, s)
            self._divide(rbuf, divide)
            copy_into(cp, out, rbuf)
        return nc.started(launch, [out], (out, list(inputs), kept, rbuf))

    # -- data movement -----------------------------------------------------------------

    def broadcast(self, a, root):
        cp, nc = self._cp, self.communicator
        # Counted in the widest unit that divides the size and the address (a copy of
        # a strided array is freshly allocated, so aligned).
        unit, count = byte_units(a.nbytes, a.data.ptr if a.flags.c_contiguous else 0)
        if count > INT_MAX and cupy_count_is_int(cp.__version__):
            raise located(ValueError, "broadcast", f"tensor has {a.nbytes} bytes, more than "
                          f"CuPy {cp.__version__} can broadcast (its count is a C int); CuPy "
                          "13.4 or later can", self.group)
        launch = nc.launch("broadcast")
        with launch as (comm, s):
            buf = contiguous(a, cp)
            if a.nbytes:
                comm.broadcast(buf.data.ptr, buf.data.ptr, count, getattr(self._nccl, unit),
                               root, s)
            if self.group.rank != root:
                copy_into(cp, a, buf)
        return nc.started(launch, [a], (a, buf))

    def all_gather_into_tensor(self, out, a):
        cp, nc, u8 = self._cp, self.communicator, self._nccl.NCCL_UINT8
        launch = nc.launch("all_gather_into_tensor")
        with launch as (comm, s):
            src = contiguous(a, cp)
            dst = out if out.flags.c_contiguous else cp.empty(out.shape, out.dtype)
            if a.nbytes:
                comm.allGather(src.data.ptr, dst.data.ptr, a.nbytes, u8, s)
            copy_into(cp, out, dst)
        return nc.started(launch, [out], (out, a, src, dst))

    def all_gather(self, outputs, a):
        cp, nc, u8, me = self._cp, self.communicator, self._nccl.NCCL_UINT8, self.group.rank
        nbytes = [o.nbytes for o in outputs]
        launch = nc.launch("all_gather")
        with launch as (comm, s):
            src = flat_bytes(cp, a)
            if nbytes.count(nbytes[0]) == len(nbytes):
                rbuf = cp.empty(len(nbytes) * a.nbytes, np.uint8)
                if a.nbytes:
                    comm.allGather(src.data.ptr, rbuf.data.ptr, a.nbytes, u8, s)
                pieces = [rbuf[i * a.nbytes:(i + 1) * a.nbytes] for i in range(len(nbytes))]
            else:  # uneven: every rank broadcasts its piece, launched together
                pieces = [src if r == me else cp.empty(n, np.uint8) for r, n in enumerate(nbytes)]
                with nc.grouped():
                    for r, piece in enumerate(pieces):
                        if nbytes[r]:
                            comm.broadcast(src.data.ptr, piece.data.ptr, nbytes[r], u8, r, s)
            for o, piece in zip(outputs, pieces):
                copy_into(cp, o, typed(piece, o))
        return nc.started(launch, list(outputs), (list(outputs), a, src, pieces))

    def all_gather_coalesced(self, output_lists, inputs):
        cp, nc, u8 = self._cp, self.communicator, self._nccl.NCCL_UINT8
        n = self.group.size
        launch = nc.launch("all_gather_coalesced")
        with launch as (comm, s):
            parts = [flat_bytes(cp, x) for x in inputs]
            sbuf = cp.concatenate(parts) if parts else cp.empty(0, np.uint8)
            rbuf = cp.empty(n * sbuf.size, np.uint8)
            if sbuf.size:
                comm.allGather(sbuf.data.ptr, rbuf.data.ptr, sbuf.size, u8, s)
            for i, outs in enumerate(output_lists):
                pos = i * sbuf.size
                for o in outs:
                    # Pieces of mixed dtypes sit at byte offsets a typed view would read
                    # misaligned (a fatal CUDA error): move them as bytes.
                    bytes_into(cp, o, rbuf[pos:pos + o.nbytes])
                    pos += o.nbytes
        return nc.started(launch, output_lists, (output_lists, inputs, sbuf, rbuf))

    def gather(self, a, outputs, root):
        cp, nc, u8, me = self._cp, self.communicator, self._nccl.NCCL_UINT8, self.group.rank
        pieces = []
        launch = nc.launch("gather")
        with launch as (comm, s):
            src = flat_bytes(cp, a)
            if me != root:
                if a.nbytes:
                    with nc.grouped():
                        comm.send(src.data.ptr, a.nbytes, u8, root, s)
            else:
                pieces = [src if r == me else cp.empty(o.nbytes, np.uint8)
                          for r, o in enumerate(outputs)]
                with nc.grouped():
                    for r, piece in enumerate(pieces):
                        if r != me and piece.size:
                            comm.recv(piece.data.ptr, piece.size, u8, r, s)
                for o, piece in zip(outputs, pieces):
                    copy_into(cp, o, typed(piece, o))
        return nc.started(launch, list(outputs or []), (outputs, a, src, pieces))

    def scatter(self, out, inputs, root):
        cp, nc, u8, me = self._cp, self.communicator, self._nccl.NCCL_UINT8, self.group.rank
        launch = nc.launch("scatter")
        with launch as (comm, s):
            if me != root:
                rbuf = cp.empty(out.nbytes, np.uint8)
                if out.nbytes:
                    with nc.grouped():
                        comm.recv(rbuf.data.ptr, out.nbytes, u8, root, s)
                copy_into(cp, out, typed(rbuf, out))
                kept = [rbuf]
            else:
                kept = [flat_bytes(cp, x) for x in inputs]
                with nc.grouped():
                    for r, src in enumerate(kept):
                        if r != me and src.size:
                            comm.send(src.data.ptr, src.size, u8, r, s)
                copy_into(cp, out, typed(kept[me], out))
        return nc.started(launch, [out], (out, inputs, kept))

    def all_to_all(self, outputs, inputs):
        cp, nc, u8, me = self._cp, self.communicator, self._nccl.NCCL_UINT8, self.group.rank
        launch = nc.launch("all_to_all")
        with launch as (comm, s):
            srcs = [flat_bytes(cp, x) for x in inputs]
            dsts = [srcs[r] if r == me else cp.empty(o.nbytes, np.uint8)
                    for r, o in enumerate(outputs)]
            with nc.grouped():
                for r in range(len(srcs)):
                    if r == me:
                        continue
                    if srcs[r].size:
                        comm.send(srcs[r].data.ptr, srcs[r].size, u8, r, s)
                    if dsts[r].size:
                        comm.recv(dsts[r].data.ptr, dsts[r].size, u8, r, s)
            for o, d in zip(outputs, dsts):
                copy_into(cp, o, typed(d, o))
        return nc.started(launch, list(outputs), (list(outputs), list(inputs), srcs, dsts))

    def all_to_all_single(self, out, a, output_counts, input_counts):
        cp, nc, u8 = self._cp, self.communicator, self._nccl.NCCL_UINT8
        me, n = self.group.rank, self.group.size
        item = a.itemsize
        if input_counts is None:
            input_counts = [a.size // n] * n
            output_counts = [out.size // n] * n
        in_off = np.concatenate([[0], np.cumsum(input_counts)]) * item
        out_off = np.concatenate([[0], np.cumsum(output_counts)]) * item
        launch = nc.launch("all_to_all_single")
        with launch as (comm, s):
            src = flat_bytes(cp, a)
            dst = out if out.flags.c_contiguous else cp.empty(out.shape, out.dtype)
            dst_u8 = dst.reshape(-1).view(np.uint8)
            with nc.grouped():
                for r in range(n):
                    if r == me:
                        continue
                    if input_counts[r]:
                        comm.send(src.data.ptr + int(in_off[r]), input_counts[r] * item, u8, r, s)
                    if output_counts[r]:
                        comm.recv(dst_u8.data.ptr + int(out_off[r]), output_counts[r] * item,
                                  u8, r, s)
            if input_counts[me]:
                dst_u8[int(out_off[me]):int(out_off[me + 1])] = src[int(in_off[me]):int(in_off[me + 1])]
            copy_into(cp, out, dst)
        return nc.started(launch, [out], (out, a, src, dst))

    def barrier(self):
        cp, nc, nccl = self._cp, self.communicator, self._nccl
        launch = nc.launch("barrier")
        with launch as (comm, s):
            buf = cp.zeros(1, np.int32)
            comm.allReduce(buf.data.ptr, buf.data.ptr, 1, nccl.NCCL_INT32, nccl.NCCL_SUM, s)
        return nc.started(launch, [], buf, blocking=True)

    # -- point to point (tags are ignored: NCCL matches by order) -------------------------

    def _check_peers(self, ops: list[P2PItem], op: str) -> None:
        for item in ops:
            if item.peer is None:
                raise located(ValueError, op, "NCCL receives need a source rank (src=None, "
                              "any source, is MPI-only)", self.group)

    def _p2p(self, op: str, ops: list[P2PItem]):
        """Enqueue the sends and receives of ``ops`` as one NCCL group; (the launch, the
        buffers to keep alive)."""
        cp, nc, u8 = self._cp, self.communicator, self._nccl.NCCL_UINT8
        launch = nc.launch(op)
        with launch as (comm, s):
            bufs = [flat_bytes(cp, a) if sending else
                    (a if a.flags.c_contiguous else cp.empty(a.shape, a.dtype)).reshape(-1).view(np.uint8)
                    for sending, a, _, _ in ops]
            with nc.grouped():
                for (sending, _, peer, _), buf in zip(ops, bufs):
                    if buf.size:
                        (comm.send if sending else comm.recv)(buf.data.ptr, buf.size, u8, peer, s)
            for (sending, a, _, _), buf in zip(ops, bufs):
                if not sending:
                    copy_into(cp, a, typed(buf, a))
        return launch, bufs

    def send(self, a, peer, tag):
        launch, bufs = self._p2p("send", [P2PItem(True, a, peer, tag)])
        return self.communicator.started(launch, [a], (a, bufs))

    def recv(self, a, peer, tag):
        ops = [P2PItem(False, a, peer, tag)]
        self._check_peers(ops, "recv")
        launch, bufs = self._p2p("recv", ops)
        return self.communicator.started(launch, [a], (a, bufs), peer=peer)

    def batch_p2p(self, ops: list[P2PItem]):
        self._check_peers(ops, "batch_isend_irecv")
        launch, bufs = self._p2p("batch_isend_irecv", ops)
        return [self.communicator.started(launch, [a], (a, bufs), op="send" if sending else "recv",
                                          peer=None if sending else peer)
                for sending, a, peer, _ in ops]
