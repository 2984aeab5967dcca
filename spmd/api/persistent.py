"""Persistent collectives: prepare a collective on fixed arrays once, start it many times.

::

    plan = spmd.api.persistent.all_reduce(grad)     # every rank, in the same order
    for step in range(steps):
        compute(grad)                           # refill the same array
        plan.start().wait()                     # or keep the Work and overlap
    plan.free()                                 # or use the plan as a context manager

With MPI-4 persistent collectives (``MPI_Allreduce_init`` and friends: MPICH >= 4.0,
Open MPI >= 5.0) the MPI library chooses its algorithm and sets up its buffers once,
and each ``start()`` is one ``MPI_Start`` plus a Work.  Where the library lacks them,
where ``SPMD_PERSISTENT=0`` is set, or for arrays MPI cannot use as they are
(non-contiguous views, float16/bfloat16 and PREMUL_SUM reductions, GPU arrays), the
plan runs the ordinary nonblocking collective at each ``start()`` instead, with the
same results; ``plan.native`` says which.  Ranks agree on the choice when the plan is
made, so a plan made on every rank never mixes the two.

Every rank of the group must make the same plans in the same order and start them in
the same order, like any collective.  Debug mode (``SPMD_DEBUG=DETAIL``) checks both:
making a plan and every ``start()`` compare the planned collective's fingerprint and
the plan's number in its group across the group (a native start is one MPI_Start, which
no engine sees).  The arrays belong to the plan until it is freed:
write inputs only between a completed start and the next one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from spmd.api import collectives as _c
from spmd.backends import checked as _checked
from spmd.backends.mpi import persistent as native
from spmd.backends.mpi.packing import PackPlan
from spmd.backends.reduction import AVERAGE, PLANS, checked_plan
from spmd.core.arrays import array_in, array_list, array_out, common_device
from spmd.core.errors import located
from spmd.core.ops import ReduceOp
from spmd.core.optable import OPS
from spmd.core.typing import Array
from spmd.core.work import Work
from spmd.runtime.group import GroupArg, ProcessGroup, resolve

__all__ = ["Plan", "available", "native_on", "all_reduce", "all_reduce_coalesced", "broadcast",
           "reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
           "barrier"]

_SUM = ReduceOp.SUM
_ndarray = np.ndarray

# Plans made per group: a plan's number, the same on every rank that makes the same plans.
_plans_made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def available() -> bool:
    """True when this MPI library runs persistent collectives and they are not turned
    off with ``SPMD_PERSISTENT=0`` (asked of the library by running one)."""
    return native.available()


def native_on(group: GroupArg = None) -> bool:
    """Whether plans on ``group`` are the library's persistent collectives: it has them
    and restarts them correctly there (asked once per group, of every rank: every member
    must call it, or make its first plan, at the same point)."""
    pg = _group(group, "native_on")
    return native.native_on(pg.context)


class Plan:
    """One prepared collective; ``start()`` runs it and returns its Work."""

    def __init__(self, name: str, pg: ProcessGroup, outputs: list[Any],
                 native_init: Callable[[], Any] | None,
                 fallback: Callable[[], Work | None],
                 finish: Callable[[], None] | None = None, keep: object = None,
                 args: tuple = (), prepare: Callable[[], None] | None = None,
                 release: Callable[[], None] | None = None):
        # prepare: run before each native start (packing inputs); release: run by free().
        self.name = name
        self.group = pg
        self._outputs = outputs
        self._finish = finish
        self._keep = keep
        self._fallback = fallback
        self._work: Work | None = None
        self._freed = False
        self._req: Any = None   # one request, or a list of them (started together)
        self._prepare = prepare
        self._release = release
        self._number = _plans_made.get(pg, 0) + 1
        _plans_made[pg] = self._number
        self._args = args  # the planned collective's engine arguments: its fingerprint
        if _checked.active:
            self._check("make")
        # The ranks agree on the kind before either starts (see native.agree).
        if native.agree(pg.context, native_init is not None and native.native_on(pg.context)):
            assert native_init is not None  # ok is False on every rank without it
            try:
                self._req = native_init()
            except NotImplementedError:  # mpi4py built against an MPI without them
                self._req = None
        self.native = self._req is not None

    def start(self) -> Work:
        """Start the collective; return its Work (wait for it before the next start).

        Raises:
            RuntimeError: the plan was freed, or its previous start has not completed.
        """
        if self._freed:
            raise located(RuntimeError, f"persistent {self.name}", "start() on a freed plan",
                          self.group.context)
        if self._work is not None and not self._work.is_completed():
            raise located(RuntimeError, f"persistent {self.name}", "start() while the previous "
                          "start is in flight; wait for its Work first", self.group.context)
        if _checked.active:
            self._check("start")
        work: Work | None
        if self._req is None:
            work = self._fallback()
            assert work is not None  # the plan's group holds this rank: a Work, not None
        else:
            if self._prepare is not None:
                self._prepare()
            work = native.start(self._req, self.name, self.group.context, self._outputs,
                                self._finish, self._keep)
        self._work = work
        return work

    def _check(self, call: str) -> None:
        """Debug mode: every rank makes (starts) the same plan here, or all raise
        CollectiveMismatchError."""
        op = f"persistent.{self.name}"
        fingerprint = OPS[op].fingerprint
        assert fingerprint is not None  # every persistent op has one (spmd.core.optable)
        fields, pairs = fingerprint(self.group.context, *self._args)
        _checked.check_call(self.group.context, op, {"call": call, "plan": self._number, **fields},
                            pairs)

    def free(self) -> None:
        """Release the MPI request; waits for a start still in flight first."""
        if self._freed:
            return
        if self._work is not None:
            self._work.wait()
        if self._req is not None:
            native.free(self._req)
            self._req = None
        if self._release is not None:
            self._release()
        self._freed = True

    def __enter__(self) -> Plan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        kind = "native" if self.native else "fallback"
        state = "freed" if self._freed else kind
        return f"<persistent.Plan {self.name} {state} group={self.group.context.name}>"


def _reduction(a, op, name: str, pg: ProcessGroup):
    """The reduction plan for ``a`` (raises on a refused dtype/op pair), and whether
    MPI can reduce ``a`` itself with an optional division afterwards."""
    plan = checked_plan(PLANS, a.dtype, op, name, pg.context)
    direct = (type(a) is _ndarray and a.flags.c_contiguous and plan.upcast is None
              and not plan.premul)
    return plan, direct


def _averager(plan, buf, n):
    if not plan.avg:
        return None
    avg = AVERAGE[plan.avg]
    return lambda: avg(buf, n)


def _group(group: GroupArg, name: str) -> ProcessGroup:
    pg = resolve(group, f"persistent.{name}")
    if pg is None:
        raise ValueError(f"persistent.{name}: this rank is not a member of the group; only "
                         "members make plans")
    return pg


def all_reduce(tensor: Array, op: ReduceOp = _SUM, group: GroupArg = None) -> Plan:
    """Plan ``spmd.all_reduce(tensor, op, group)``: in place, on every rank."""
    pg = _group(group, "all_reduce")
    a, _ = array_out(tensor, "persistent.all_reduce", "tensor", pg.context)
    plan, direct = _reduction(a, op, "persistent.all_reduce", pg)
    init = (lambda: native.all_reduce(pg.context, a, plan)) if direct else None
    return Plan("all_reduce", pg, [a], init,
                lambda: _c.all_reduce(a, op, pg, async_op=True),
                _averager(plan, a, pg.context.size), a, (a, op))


def all_reduce_coalesced(tensors: list[Array], op: ReduceOp = _SUM,
                         group: GroupArg = None) -> Plan:
    """Plan ``spmd.all_reduce_coalesced(tensors, op, group)``: the training-loop case of
    the same arrays fused every step.

    The arrays are packed into one buffer per dtype (and fusion bucket) whose layout is
    built once, and each buffer gets a persistent all-reduce: a start is one C copy in,
    one ``MPI_Startall`` and, on completion, one C copy out per bucket, with no Python
    per array.  Where the shared-memory engine fuses the arrays (one bucket at its
    sizes), a start is its fused all-reduce instead, which is faster (``plan.native``
    is then False).  The arrays must stay the same objects (refill them in place).
    """
    name = "persistent.all_reduce_coalesced"
    pg = _group(group, "all_reduce_coalesced")
    dev = common_device(name, pg.context, ("tensors", tensors))
    arrays = array_list(tensors, name, "tensors", pg.context, None, out=True)
    if not arrays:
        raise located(ValueError, name, "tensors is empty", pg.context)
    by_dtype: dict[Any, list] = {}
    for a in arrays:
        by_dtype.setdefault(a.dtype, []).append(a)
    plans = {dt: checked_plan(PLANS, dt, op, name, pg.context) for dt in by_dtype}
    # The shared-memory engine's fused all-reduce beats MPI's persistent one where it
    # takes the arrays (one bucket at its sizes): the plan then starts it (not native).
    engine = pg.engines[dev]
    fused = engine.fused_start(arrays, op)
    direct = fused is None and dev == "cpu" and \
        all(p.upcast is None and not p.premul for p in plans.values()) and \
        all(a.flags.c_contiguous for a in arrays)
    packs: list[tuple[PackPlan, Any]] = []

    def release():
        for pack, _ in packs:
            pack.free()
        packs.clear()

    def init():
        reqs: list = []
        try:
            for dt, run in by_dtype.items():
                packs.append((PackPlan(run, dt), plans[dt]))
                reqs.extend(native.all_reduce_buffers(pg.context, packs[-1][0].bufs, plans[dt]))
        except BaseException:
            native.free(reqs)
            release()
            raise
        return reqs

    def prepare():
        for pack, _ in packs:
            pack.pack()

    n = pg.context.size

    def finish():
        for pack, plan in packs:
            if plan.avg:
                for buf in pack.bufs:
                    AVERAGE[plan.avg](buf, n)
            pack.unpack()

    return Plan("all_reduce_coalesced", pg, arrays, init if direct else None,
                fused or (lambda: pg.engines[dev].all_reduce_coalesced(arrays, op)),
                finish, packs, (arrays, op), prepare=prepare, release=release)


def broadcast(tensor: Array, src: int | None = None, group: GroupArg = None,
              group_src: int | None = None) -> Plan:
    """Plan ``spmd.broadcast(tensor, src, group)``."""
    pg = _group(group, "broadcast")
    root = _c.root_rank(pg, "persistent.broadcast", src, group_src, "src")
    a, _ = array_out(tensor, "persistent.broadcast", "tensor", pg.context)
    direct = type(a) is _ndarray and a.flags.c_contiguous
    init = (lambda: native.broadcast(pg.context, a, root)) if direct else None
    return Plan("broadcast", pg, [a], init,
                lambda: _c.broadcast(a, group=pg, async_op=True, group_src=root), None, a,
                (a, root))


def reduce(tensor: Array, dst: int | None = None, op: ReduceOp = _SUM, group: GroupArg = None,
           group_dst: int | None = None) -> Plan:
    """Plan ``spmd.reduce(tensor, dst, op, group)``: the result lands on ``dst`` only."""
    pg = _group(group, "reduce")
    root = _c.root_rank(pg, "persistent.reduce", dst, group_dst, "dst")
    is_root = pg.context.rank == root
    a, _ = (array_out if is_root else array_in)(tensor, "persistent.reduce", "tensor", pg.context)
    plan, direct = _reduction(a, op, "persistent.reduce", pg)
    init = (lambda: native.reduce(pg.context, a, plan, root)) if direct else None
    return Plan("reduce", pg, [a], init,
                lambda: _c.reduce(a, op=op, group=pg, async_op=True, group_dst=root),
                _averager(plan, a, pg.context.size) if is_root else None, a, (a, root, op))


def _gather_shapes(out, a, name: str, pg: ProcessGroup, n_out_per_in: bool) -> None:
    if out.dtype != a.dtype:
        raise located(TypeError, name, f"output has dtype {out.dtype}, expected {a.dtype} "
                      "(the dtype of input)", pg.context)
    big, small = (out, a) if n_out_per_in else (a, out)
    if big.size != pg.context.size * small.size:
        which = "output" if n_out_per_in else "input"
        other = "input" if n_out_per_in else "output"
        raise located(ValueError, name, f"{which} has {big.size} elements, expected world_size "
                      f"({pg.context.size}) x {other} ({small.size}) = {pg.context.size * small.size}", pg.context)


def all_gather_into_tensor(output_tensor: Array, input_tensor: Array,
                           group: GroupArg = None) -> Plan:
    """Plan ``spmd.all_gather_into_tensor(output_tensor, input_tensor, group)``."""
    name = "persistent.all_gather_into_tensor"
    pg = _group(group, "all_gather_into_tensor")
    a, _ = array_in(input_tensor, name, "input_tensor", pg.context)
    out, _ = array_out(output_tensor, name, "output_tensor", pg.context)
    _gather_shapes(out, a, name, pg, True)
    direct = type(a) is _ndarray and type(out) is _ndarray and a.flags.c_contiguous \
        and out.flags.c_contiguous
    init = (lambda: native.all_gather(pg.context, out, a)) if direct else None
    return Plan("all_gather_into_tensor", pg, [out], init,
                lambda: _c.all_gather_into_tensor(out, a, pg, async_op=True), None, (a, out),
                (out, a))


def reduce_scatter_tensor(output: Array, input: Array, op: ReduceOp = _SUM,  # noqa: A002
                          group: GroupArg = None) -> Plan:
    """Plan ``spmd.reduce_scatter_tensor(output, input, op, group)``."""
    name = "persistent.reduce_scatter_tensor"
    pg = _group(group, "reduce_scatter_tensor")
    out, _ = array_out(output, name, "output", pg.context)
    a, _ = array_in(input, name, "input", pg.context)
    _gather_shapes(out, a, name, pg, False)
    plan, direct = _reduction(a, op, name, pg)
    direct = direct and type(out) is _ndarray and out.flags.c_contiguous
    init = (lambda: native.reduce_scatter(pg.context, out, a, plan)) if direct else None
    return Plan("reduce_scatter_tensor", pg, [out], init,
                lambda: _c.reduce_scatter_tensor(out, a, op, pg, async_op=True),
                _averager(plan, out, pg.context.size), (a, out), (out, a, op))


def all_to_all_single(output: Array, input: Array,  # noqa: A002
                      group: GroupArg = None) -> Plan:
    """Plan ``spmd.all_to_all_single(output, input, group=group)`` with equal splits."""
    name = "persistent.all_to_all_single"
    pg = _group(group, "all_to_all_single")
    a, _ = array_in(input, name, "input", pg.context)
    out, _ = array_out(output, name, "output", pg.context)
    if out.dtype != a.dtype or out.size != a.size or a.ndim == 0 or a.shape[0] % pg.context.size:
        raise located(ValueError, name, f"input and output need the same dtype and size and a "
                      f"first dimension divisible by the group size ({pg.context.size}); got input "
                      f"{a.dtype}{list(a.shape)}, output {out.dtype}{list(out.shape)}", pg.context)
    direct = type(a) is _ndarray and type(out) is _ndarray and a.flags.c_contiguous \
        and out.flags.c_contiguous
    init = (lambda: native.all_to_all(pg.context, out, a)) if direct else None
    return Plan("all_to_all_single", pg, [out], init,
                lambda: _c.all_to_all_single(out, a, group=pg, async_op=True), None, (a, out),
                (out, a, None, None))


def barrier(group: GroupArg = None) -> Plan:
    """Plan ``spmd.barrier(group)``."""
    pg = _group(group, "barrier")
    return Plan("barrier", pg, [], lambda: native.barrier(pg.context),
                lambda: _c.barrier(pg, async_op=True))
