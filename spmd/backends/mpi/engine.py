"""The MPI backend: host arrays through mpi4py's nonblocking collectives.

Every method starts one (or a few) nonblocking MPI calls on the group's private
communicator and returns a Work.  Arrays MPI cannot use as they are (non-contiguous
views, float16/bfloat16 reductions, PREMUL_SUM scaling) go through a staging buffer
whose result the Work writes back into the caller's array when it completes.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from spmd.backends.base import Engine
from spmd.backends.mpi.packing import pack_buckets
from spmd.backends.mpi.routes import reduced_route
from spmd.backends.mpi.work import MPIWork
from spmd.backends.reduction import (
    AVERAGE,
    PLANS,
    ReductionPlan,
    checked_plan,
    counts_displs,
    mpi_view,
    premul_factor,
)
from spmd.core.arrays import MOVE_AS, contiguous, movable
from spmd.core.context import GroupContext
from spmd.core.errors import located
from spmd.core.work import Work

__all__ = ["MPIEngine", "OBJECT_TAG", "check_tag"]

_IN_PLACE = MPI.IN_PLACE
_ANY_SOURCE = MPI.ANY_SOURCE


def _tag_ub() -> int:
    ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    assert ub is not None  # MPI defines TAG_UB on every communicator
    return ub


# Tags a user may give are below this one, the largest MPI carries: it is kept for
# spmd's own object messages (send_object_list).
OBJECT_TAG = _tag_ub()


def check_tag(tag, op: str, ctx: GroupContext) -> int:
    """``tag`` if it is one a user may give (an int in [0, OBJECT_TAG)), else raise."""
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise located(TypeError, op, f"tag must be an int, got {type(tag).__name__}", ctx)
    if not 0 <= tag < OBJECT_TAG:
        raise located(ValueError, op, f"tag={tag} is out of range [0, {OBJECT_TAG})", ctx)
    return tag

_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)


def _pack(arrays: list, dtype: np.dtype) -> np.ndarray:
    """Concatenate arrays, flattened, into one new buffer of ``dtype``."""
    total = sum(a.size for a in arrays)
    buf = np.empty(total, dtype)
    pos = 0
    for a in arrays:
        buf[pos:pos + a.size] = a.reshape(-1)
        pos += a.size
    return buf


def _unpack_into(outputs: list, buf: np.ndarray) -> None:
    pos = 0
    for o in outputs:
        np.copyto(o, buf[pos:pos + o.size].reshape(o.shape), casting="unsafe")
        pos += o.size


def _recv_buffer(out: np.ndarray, dtype=None) -> np.ndarray:
    """Where MPI writes a result for ``out``: ``out`` itself when it can."""
    if dtype is None and out.flags.c_contiguous:
        return out
    return np.empty(out.shape, dtype or out.dtype)


class MPIEngine(Engine):
    """MPI collectives and point-to-point operations on host (numpy) arrays."""

    name = "mpi"

    def __init__(self, group: GroupContext):
        super().__init__(group)
        self.comm = group.comm
        self.rank = group.rank
        self.size = group.size

    # -- helpers -----------------------------------------------------------------

    def reduction_plan(self, dtype: np.dtype, op, opname: str) -> ReductionPlan:
        return checked_plan(PLANS, dtype, op, opname, self.group)

    @staticmethod
    def _stage(a: np.ndarray, plan: ReductionPlan, op, may_modify: bool) -> np.ndarray:
        """The buffer MPI reduces: ``a`` itself when possible, else a prepared copy."""
        if plan.upcast is not None:
            buf = a.astype(plan.upcast)
        elif a.flags.c_contiguous and (may_modify or not plan.premul):
            buf = a
        else:
            buf = np.array(a, order="C")
        if plan.premul:
            np.multiply(buf, premul_factor(op), out=buf, casting="unsafe")
        return buf

    def _finisher(self, out: np.ndarray, buf: np.ndarray, plan: ReductionPlan):
        """What completion does: divide for AVG, copy a staged result back into ``out``."""
        avg = AVERAGE[plan.avg] if plan.avg else None
        if buf is out and avg is None:
            return None
        n = self.size

        def finish():
            if avg is not None:
                avg(buf, n)
            if buf is not out:
                np.copyto(out, buf, casting="unsafe")

        return finish

    def _work(self, reqs, op, outputs, *, finish=None, keep=None, status=None) -> Work:
        return MPIWork(reqs, op, self.group, outputs, finish=finish, keep=keep, status=status)

    # -- reductions --------------------------------------------------------------

    def all_reduce(self, a, op):
        # The common case (a pair MPI reduces itself, a contiguous array) takes its
        # route (two dict lookups); anything else, refusals included, goes through the
        # checked path below.
        route = reduced_route(a.dtype, op)
        if route is not None and a.flags.c_contiguous:
            req = self.comm.Iallreduce(_IN_PLACE, a if route.view is None else a.view(route.view),
                                       route.mpi_op)
            return MPIWork([req], "all_reduce", self.group, [a], keep=a)
        plan = self.reduction_plan(a.dtype, op, "all_reduce")
        buf = self._stage(a, plan, op, True)
        req = self.comm.Iallreduce(_IN_PLACE, mpi_view(buf, plan), plan.mpi_op)
        return self._work([req], "all_reduce", [a], finish=self._finisher(a, buf, plan), keep=buf)

    def all_reduce_coalesced(self, tensors, op):
        dt = tensors[0].dtype
        if all(t.dtype is dt for t in tensors):  # one dtype (the usual case): no grouping
            by_dtype: dict[np.dtype, list] = {dt: tensors}
        else:
            by_dtype = {}
            for t in tensors:
                by_dtype.setdefault(t.dtype, []).append(t)
        plans = {dt: self.reduction_plan(dt, op, "all_reduce_coalesced") for dt in by_dtype}
        reqs, packed = [], []
        for dt, arrays in by_dtype.items():
            plan = plans[dt]
            # One collective per bucket of at most the fusion threshold's bytes.
            for p in pack_buckets(arrays, plan.upcast or dt, plan.upcast is None
                                  and not plan.premul):
                if plan.premul:
                    np.multiply(p.buf, premul_factor(op), out=p.buf, casting="unsafe")
                reqs.append(self.comm.Iallreduce(_IN_PLACE, mpi_view(p.buf, plan), plan.mpi_op))
                packed.append((p, AVERAGE[plan.avg] if plan.avg else None))
        n = self.size

        def finish():
            for p, avg in packed:
                if avg is not None:
                    avg(p.buf, n)
                p.unpack()

        return MPIWork(reqs, "all_reduce_coalesced", self.group, list(tensors), finish=finish, keep=packed)

    def reduce(self, a, root, op):
        route = reduced_route(a.dtype, op)
        if route is not None and a.flags.c_contiguous:
            m = a if route.view is None else a.view(route.view)
            if self.rank == root:
                req = self.comm.Ireduce(_IN_PLACE, m, route.mpi_op, root)
            else:
                req = self.comm.Ireduce(m, None, route.mpi_op, root)
            return MPIWork([req], "reduce", self.group, [a], keep=a)
        plan = self.reduction_plan(a.dtype, op, "reduce")
        is_root = self.rank == root
        buf = self._stage(a, plan, op, is_root)
        if is_root:
            req = self.comm.Ireduce(_IN_PLACE, mpi_view(buf, plan), plan.mpi_op, root)
            return self._work([req], "reduce", [a], finish=self._finisher(a, buf, plan), keep=buf)
        req = self.comm.Ireduce(mpi_view(buf, plan), None, plan.mpi_op, root)
        return self._work([req], "reduce", [a], keep=buf)

    def reduce_scatter_tensor(self, out, a, op):
        route = reduced_route(a.dtype, op)
        if route is not None and a.flags.c_contiguous and out.flags.c_contiguous:
            view = route.view
            req = self.comm.Ireduce_scatter_block(a if view is None else a.view(view),
                                                  out if view is None else out.view(view),
                                                  route.mpi_op)
            return MPIWork([req], "reduce_scatter_tensor", self.group, [out], keep=(a, out))
        plan = self.reduction_plan(a.dtype, op, "reduce_scatter_tensor")
        buf = self._stage(a, plan, op, False)
        rbuf = _recv_buffer(out, plan.upcast)
        req = self.comm.Ireduce_scatter_block(mpi_view(buf, plan), mpi_view(rbuf, plan), plan.mpi_op)
        return self._work([req], "reduce_scatter_tensor", [out],
                          finish=self._finisher(out, rbuf, plan), keep=(buf, rbuf))

    def reduce_scatter(self, out, inputs, op):
        plan = self.reduction_plan(out.dtype, op, "reduce_scatter")
        buf = _pack(inputs, plan.upcast or out.dtype)
        if plan.premul:
            np.multiply(buf, premul_factor(op), out=buf, casting="unsafe")
        rbuf = _recv_buffer(out, plan.upcast)
        counts = [x.size for x in inputs]
        req = self.comm.Ireduce_scatter(mpi_view(buf, plan), mpi_view(rbuf, plan), counts, plan.mpi_op)
        return self._work([req], "reduce_scatter", [out], finish=self._finisher(out, rbuf, plan), keep=(buf, rbuf))

    # -- data movement -----------------------------------------------------------

    def broadcast(self, a, root):
        if a.flags.c_contiguous:  # the common case: MPI moves the array itself
            view = MOVE_AS[a.dtype]
            req = self.comm.Ibcast(a if view is None else a.view(view), root)
            return MPIWork([req], "broadcast", self.group, [a], keep=a)
        buf = contiguous(a)
        req = self.comm.Ibcast(movable(buf), root)
        finish = None if buf is a or self.rank == root else (lambda: np.copyto(a, buf))
        return self._work([req], "broadcast", [a], finish=finish, keep=buf)

    def all_gather(self, outputs, a):
        src = movable(contiguous(a))
        counts = [o.size for o in outputs]
        rbuf = np.empty(sum(counts), a.dtype)
        if counts.count(counts[0]) == len(counts):
            req = self.comm.Iallgather(src, movable(rbuf))
        else:
            req = self.comm.Iallgatherv(src, [movable(rbuf), counts_displs(counts)])
        return self._work([req], "all_gather", list(outputs),
                          finish=lambda: _unpack_into(outputs, rbuf), keep=(src, rbuf))

    def all_gather_into_tensor(self, out, a):
        if a.flags.c_contiguous and out.flags.c_contiguous:
            view = MOVE_AS[a.dtype]
            if view is None:
                req = self.comm.Iallgather(a, out)
            else:
                req = self.comm.Iallgather(a.view(view), out.view(view))
            return MPIWork([req], "all_gather_into_tensor", self.group, [out], keep=(a, out))
        src = movable(contiguous(a))
        rbuf = _recv_buffer(out)
        req = self.comm.Iallgather(src, movable(rbuf))
        finish = None if rbuf is out else (lambda: np.copyto(out, rbuf))
        return self._work([req], "all_gather_into_tensor", [out], finish=finish, keep=(src, rbuf))

    def all_gather_coalesced(self, output_lists, inputs):
        # Arrays of any dtypes travel together as bytes: one collective for the batch.
        sbuf = _pack([x.reshape(-1).view(_U8) if x.flags.c_contiguous
                      else np.ascontiguousarray(x).reshape(-1).view(_U8) for x in inputs], _U8)
        rbuf = np.empty(sbuf.size * self.size, _U8)
        req = self.comm.Iallgather(sbuf, rbuf)

        def finish():
            rows = rbuf.reshape(self.size, -1)
            for outs, row in zip(output_lists, rows):
                pos = 0
                for o in outs:
                    nbytes = o.size * o.itemsize
                    np.copyto(o, row[pos:pos + nbytes].view(o.dtype).reshape(o.shape))
                    pos += nbytes

        return self._work([req], "all_gather_coalesced", output_lists, finish=finish, keep=(sbuf, rbuf))

    def gather(self, a, outputs, root):
        src = movable(contiguous(a))
        if self.rank != root:
            req = self.comm.Igather(src, None, root)
            return self._work([req], "gather", [], keep=src)
        rbuf = np.empty(a.size * self.size, a.dtype)
        req = self.comm.Igather(src, movable(rbuf), root)
        return self._work([req], "gather", list(outputs), finish=lambda: _unpack_into(outputs, rbuf), keep=(src, rbuf))

    def scatter(self, out, inputs, root):
        rbuf = _recv_buffer(out)
        sbuf = _pack(inputs, out.dtype) if self.rank == root else None
        req = self.comm.Iscatter(None if sbuf is None else movable(sbuf), movable(rbuf), root)
        finish = None if rbuf is out else (lambda: np.copyto(out, rbuf))
        return self._work([req], "scatter", [out], finish=finish, keep=(sbuf, rbuf))

    def all_to_all(self, outputs, inputs):
        sbuf = _pack(inputs, inputs[0].dtype if inputs else outputs[0].dtype)
        rcounts = [o.size for o in outputs]
        rbuf = np.empty(sum(rcounts), sbuf.dtype)
        req = self.comm.Ialltoallv([movable(sbuf), counts_displs([x.size for x in inputs])],
                                   [movable(rbuf), counts_displs(rcounts)])
        return self._work([req], "all_to_all", list(outputs),
                          finish=lambda: _unpack_into(outputs, rbuf), keep=(sbuf, rbuf))

    def all_to_all_single(self, out, a, output_counts, input_counts):
        if input_counts is None and a.flags.c_contiguous and out.flags.c_contiguous:
            view = MOVE_AS[a.dtype]
            if view is None:
                req = self.comm.Ialltoall(a, out)
            else:
                req = self.comm.Ialltoall(a.view(view), out.view(view))
            return MPIWork([req], "all_to_all_single", self.group, [out], keep=(a, out))
        src = movable(contiguous(a))
        rbuf = _recv_buffer(out)
        if input_counts is None:
            req = self.comm.Ialltoall(src, movable(rbuf))
        else:
            req = self.comm.Ialltoallv([src, counts_displs(input_counts)],
                                       [movable(rbuf), counts_displs(output_counts)])
        finish = None if rbuf is out else (lambda: np.copyto(out, rbuf))
        return self._work([req], "all_to_all_single", [out], finish=finish, keep=(src, rbuf))

    def barrier(self):
        return MPIWork([self.comm.Ibarrier()], "barrier", self.group, [])

    # -- point to point ----------------------------------------------------------

    def send(self, a, peer, tag):
        if a.flags.c_contiguous:
            view = MOVE_AS[a.dtype]
            req = self.comm.Isend(a if view is None else a.view(view), peer, tag)
            return MPIWork([req], "send", self.group, [a], keep=a)
        buf = movable(contiguous(a))
        return self._work([self.comm.Isend(buf, peer, tag)], "send", [a], keep=buf)

    def recv(self, a, peer, tag):
        if a.flags.c_contiguous:
            view = MOVE_AS[a.dtype]
            status = MPI.Status()
            req = self.comm.Irecv(a if view is None else a.view(view),
                                  _ANY_SOURCE if peer is None else peer, tag)
            return MPIWork([req], "recv", self.group, [a], keep=a, status=status)
        buf = _recv_buffer(a)
        status = MPI.Status()
        req = self.comm.Irecv(movable(buf), MPI.ANY_SOURCE if peer is None else peer, tag)
        finish = None if buf is a else (lambda: np.copyto(a, buf))
        return self._work([req], "recv", [a], finish=finish, keep=buf, status=status)
