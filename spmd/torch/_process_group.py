"""The torch ProcessGroup of the spmd backend: torch's ops on an spmd group.

torch's C++ ``Backend`` cannot be subclassed from Python in torch 2.13, but
``ProcessGroup`` can: torch then uses the object as the whole group.  Its C++
trampoline forwards allreduce, broadcast, allgather, all_gather_single, reduce_scatter,
reduce_scatter_single, all_to_all_single, barrier, send, recv and the coalesced forms to
the Python methods here; reduce, gather, scatter, alltoall, recv_anysource and
allgather_coalesced are called from torch's Python.  A Python method hides every
pybind overload of its name, so each accepts torch's option objects and the older
positional forms (a single tensor, a root, an op).

Every op is one of spmd's public collectives on numpy views of the tensors, so torch
tensors get what numpy arrays get (shared memory, diagnosed timeouts, the flight recorder,
debug mode, the comms log).  A call torch waits for at once (``opts.asyncOp`` False) is
spmd's blocking call, on the compiled path where it takes it, and torch gets no Work (its
API then skips the wait); any other call starts the op and returns an SpmdWork.

The hot collectives (allreduce, broadcast, all_gather_single, reduce_scatter_single,
barrier) first try their common case in their own frame: torch waits at once with no
timeout of the op's own and no coalescing block, a SUM, tensors whose numpy views are
kept (``spmd.torch._tensors.views``: small contiguous CPU tensors seen before).  Then
the kept views go straight to the compiled path's entry (``fastcall.direct``), which
runs the op or declines having done nothing; anything else, and every decline, takes the
op's full path below, which checks everything and makes the views.  The condition is
written out in each method, not in a helper: each helper is one more Python frame on
the hottest calls.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

import spmd
from spmd.backends.mpi.fastcall import direct
from spmd.core.cuda import cupy_or_none
from spmd.core.errors import located
from spmd.torch._errors import raising_torch_errors
from spmd.torch._options import (
    SUM,
    SUM_SPMD,
    SUM_TORCH,
    UNSET_TIMEOUT,
    one_tensor,
    reduce_of,
    timeout_of,
)
from spmd.torch._reconfigure import enable as enable_reconfigure
from spmd.torch._reconfigure import handle as reconfigure_handle
from spmd.torch._reconfigure import reconfigure as reconfigure_default
from spmd.torch._sharded_tensor import answer_device_without_shards
from spmd.torch._store import ensure_spmd, owns_world, release_world
from spmd.torch._tensors import host_in, host_out, reduce_op, same_storage, views
from spmd.torch._work import FutureWork, SpmdWork

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName  # for the annotation only

__all__ = ["SpmdProcessGroup", "create"]

_CPU, _CUDA = torch.device("cpu"), torch.device("cuda")


class SpmdProcessGroup(dist.ProcessGroup):
    """A torch.distributed ProcessGroup whose ops run on an spmd ProcessGroup.

    Made by torch for ``init_process_group("spmd")`` and ``new_group(...)`` (also via
    DeviceMesh and ``new_subgroups``); every rank of the group must make the same calls
    in the same order, as with any torch backend.
    """

    def __init__(self, group: spmd.ProcessGroup, rank: int, size: int,
                 timeout: timedelta | None, owns: str):
        # torch's stub lists only the (store, rank, size) constructor; c10d also has the
        # (rank, size) one, for process groups without a store.
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._spmd = group
        self._owns = owns  # "world": destroy spmd with it; "group": free its group; ""
        self._timeout = timeout
        self._name = ""
        self._desc = ""
        self._coalescing: list | None = None

    # -- identity ---------------------------------------------------------------------

    @property
    def spmd_group(self) -> spmd.ProcessGroup:
        """The spmd ProcessGroup underneath (for spmd's own API on the same ranks)."""
        return self._spmd

    @property
    def _device_types(self) -> list[torch.device]:
        """The devices whose tensors the group moves (torch reads it to place object
        collectives and sharded state dicts): CPU, and CUDA where spmd has CuPy."""
        if torch.cuda.is_available() and cupy_or_none() is not None:
            return [_CPU, _CUDA]
        return [_CPU]

    def _get_backend(self, device=None):
        """The group itself for every device it serves: torch's ``Backend`` cannot be
        subclassed from Python, so the group is its own backend (torch's helpers that
        look one up, such as ``_set_pg_timeout``, then find no gloo or NCCL in it)."""
        return self

    def getBackendName(self) -> str:
        return "spmd"

    def name(self) -> str:
        return "spmd"

    _get_backend_name = getBackendName

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    _set_group_name = setGroupName
    _set_group_desc = setGroupDesc

    @property
    def group_name(self) -> GroupName:
        return cast("GroupName", self._name)  # torch's NewType of str

    @property
    def group_desc(self) -> str:
        return self._desc

    def __repr__(self) -> str:
        return (f"<SpmdProcessGroup {self._name or '?'} rank={self.rank()} size={self.size()} "
                f"spmd={self._spmd.name}>")

    # -- plumbing ---------------------------------------------------------------------

    def _waited(self, opts) -> bool:
        """Whether torch waits for the op at once (``opts.asyncOp`` False), with no timeout
        of the op's own (a blocking call waits under the group's) and no coalescing block
        to collect its Work: then it is spmd's blocking call, and torch gets no Work."""
        if getattr(opts, "asyncOp", True) or self._coalescing is not None:
            return False
        return opts.timeout == UNSET_TIMEOUT or timeout_of(opts) is None

    def _issue(self, opts, outputs, name: str, call, /, *args, **kwargs) -> SpmdWork | None:
        """Run ``call`` (spmd's op ``name``) on this group: blocking where torch waits at
        once (:meth:`_waited`; torch gets None), else started, its Work returned."""
        if self._waited(opts):
            call(*args, group=self._spmd, **kwargs)
            return None
        return self._work([call(*args, group=self._spmd, async_op=True, **kwargs)], outputs,
                          name, opts)

    def _work(self, works, outputs, op, opts=None, finish=None) -> SpmdWork:
        work = SpmdWork(works, outputs, op, self._spmd, finish, timeout_of(opts))
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    # -- collectives ------------------------------------------------------------------

    def allreduce(self, tensors, opts=None, op=None, timeout=None):
        """All-reduce one tensor in place (``opts``: AllreduceOptions or a ReduceOp)."""
        if type(opts) is AllreduceOptions and not opts.asyncOp and op is None and \
                opts.timeout == UNSET_TIMEOUT and self._coalescing is None and \
                type(tensors) is list and len(tensors) == 1 and opts.reduceOp == SUM_TORCH:
            a = views.get(tensors[0])
            if a is not None and direct.all_reduce(a, SUM_SPMD, self._spmd):
                return None
        ctx = self._spmd.context
        t = one_tensor(tensors, "allreduce", "tensors", ctx)
        red = reduce_of(op if op is not None else opts)
        a = host_out(t, "all_reduce", "tensor", ctx, True)
        if self._waited(opts):   # (the hottest call: _issue's steps, inline)
            spmd.all_reduce(a, red, group=self._spmd)
            return None
        w = spmd.all_reduce(a, red, group=self._spmd, async_op=True)
        return self._work([w], [t], "all_reduce", opts)

    def allreduce_coalesced(self, tensors, opts=None):
        """All-reduce a list of tensors, fused into one collective per dtype bucket."""
        red = reduce_of(opts)
        arrays = [host_out(t, "all_reduce_coalesced", f"tensors[{i}]", self._spmd.context, True)
                  for i, t in enumerate(tensors)]
        with spmd.coalescing_manager(group=self._spmd, async_ops=True) as cm:
            for a in arrays:
                spmd.all_reduce(a, red, group=self._spmd, async_op=True)
        return self._work(list(cm.works), list(tensors), "all_reduce_coalesced", opts)

    def broadcast(self, tensors, opts=None):
        """Broadcast from group rank ``opts.rootRank`` (or ``broadcast(tensor, root)``)."""
        if type(opts) is BroadcastOptions and not opts.asyncOp and opts.rootTensor == 0 and \
                opts.timeout == UNSET_TIMEOUT and self._coalescing is None and \
                type(tensors) is list and len(tensors) == 1:
            a = views.get(tensors[0])
            if a is not None and direct.broadcast(a, None, self._spmd, opts.rootRank):
                return None
        t = one_tensor(tensors, "broadcast", "tensors", self._spmd.context)
        if isinstance(opts, int):
            root = opts
        else:
            opts = opts or BroadcastOptions()
            if opts.rootTensor != 0:
                raise located(ValueError, "broadcast", f"rootTensor={opts.rootTensor}; one "
                              "tensor per process means rootTensor 0", self._spmd.context)
            root = opts.rootRank
        a = host_out(t, "broadcast", "tensor", self._spmd.context)
        return self._issue(opts, [t], "broadcast", spmd.broadcast, a, group_src=root)

    def reduce(self, tensors, opts=None, op=None):
        """Reduce into group rank ``opts.rootRank`` (or ``reduce(tensor, root, op)``)."""
        t = one_tensor(tensors, "reduce", "tensors", self._spmd.context)
        if isinstance(opts, int):
            root, red, opts = opts, reduce_op(op if op is not None else SUM), None
        else:
            opts = opts or ReduceOptions()
            root, red = opts.rootRank, reduce_op(opts.reduceOp)
        mine = self._spmd.rank() == root
        a = (host_out if mine else host_in)(t, "reduce", "tensor", self._spmd.context, True)
        return self._issue(opts, [t], "reduce", spmd.reduce, a, group_dst=root, op=red)

    def allgather(self, output_tensors, input_tensors, opts=None):
        """All-gather (list form; sizes may differ per rank)."""
        t = one_tensor(input_tensors, "allgather", "input_tensors", self._spmd.context)
        outs = output_tensors[0] if output_tensors and isinstance(output_tensors[0], (list, tuple)) \
            else output_tensors
        if len(output_tensors) != 1 and outs is not output_tensors:
            raise located(ValueError, "allgather", "output_tensors must hold one list (one per "
                          "process)", self._spmd.context)
        if any(same_storage(o, t) for o in outs):
            t = t.clone()
        a = host_in(t, "all_gather", "tensor", self._spmd.context)
        arrays = [host_out(o, "all_gather", f"tensor_list[{i}]", self._spmd.context) for i, o in enumerate(outs)]
        return self._issue(opts, output_tensors, "all_gather", spmd.all_gather, arrays, a)

    def all_gather_single(self, output, input, opts=None):
        """All-gather into one tensor (``all_gather_into_tensor``)."""
        if type(opts) is AllgatherOptions and not opts.asyncOp and \
                opts.timeout == UNSET_TIMEOUT and self._coalescing is None:
            pair = views.get_pair(output, input)
            if pair is not None and direct.all_gather_into_tensor(*pair, self._spmd):
                return None
        if same_storage(output, input):
            input = input.clone()
        a = host_in(input, "all_gather_into_tensor", "input_tensor", self._spmd.context)
        out = host_out(output, "all_gather_into_tensor", "output_tensor", self._spmd.context)
        return self._issue(opts, [output], "all_gather_into_tensor", spmd.all_gather_into_tensor, out, a)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """Several all_gather_into_tensor calls as one fused all-gather."""
        pairs = []
        for i, (o, x) in enumerate(zip(outputs, inputs)):
            if same_storage(o, x):
                x = x.clone()
            pairs.append((host_out(o, "all_gather_into_tensor", f"outputs[{i}]", self._spmd.context),
                          host_in(x, "all_gather_into_tensor", f"inputs[{i}]", self._spmd.context)))
        with spmd.coalescing_manager(group=self._spmd, async_ops=True) as cm:
            for out, a in pairs:
                spmd.all_gather_into_tensor(out, a, group=self._spmd, async_op=True)
        return self._work(list(cm.works), list(outputs), "all_gather_coalesced", opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """All-gather a list of tensors: ``output_lists[rank][j]`` gets rank's input j."""
        ins = [host_in(t, "all_gather_coalesced", f"input_tensor_list[{j}]", self._spmd.context)
               for j, t in enumerate(input_list)]
        outs = [[host_out(o, "all_gather_coalesced", f"output_tensor_lists[{r}][{j}]", self._spmd.context)
                 for j, o in enumerate(row)] for r, row in enumerate(output_lists)]
        fut = spmd.all_gather_coalesced(outs, ins, group=self._spmd, async_op=True)
        return self._work([FutureWork(fut)], output_lists, "all_gather_coalesced", opts)

    def gather(self, output_tensors, input_tensors, opts=None):
        """Gather into group rank ``opts.rootRank``: ``output_tensors`` is
        ``[gather_list]`` there and ``[]`` elsewhere."""
        opts = opts or GatherOptions()
        t = one_tensor(input_tensors, "gather", "input_tensors", self._spmd.context)
        root = opts.rootRank
        outs = None
        if self._spmd.rank() == root:
            lst = output_tensors[0] if output_tensors else []
            outs = [host_out(o, "gather", f"gather_list[{i}]", self._spmd.context) for i, o in enumerate(lst)]
            if any(same_storage(o, t) for o in lst):
                t = t.clone()
        a = host_in(t, "gather", "tensor", self._spmd.context)
        return self._issue(opts, output_tensors, "gather", spmd.gather, a, outs, group_dst=root)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """Scatter from group rank ``opts.rootRank``: ``input_tensors`` is
        ``[scatter_list]`` there and ``[]`` elsewhere."""
        opts = opts or ScatterOptions()
        t = one_tensor(output_tensors, "scatter", "output_tensors", self._spmd.context)
        root = opts.rootRank
        ins = None
        if self._spmd.rank() == root:
            lst = input_tensors[0] if input_tensors else []
            ins = [host_in(x.clone() if same_storage(x, t) else x, "scatter",
                           f"scatter_list[{i}]", self._spmd.context) for i, x in enumerate(lst)]
        out = host_out(t, "scatter", "tensor", self._spmd.context)
        return self._issue(opts, [t], "scatter", spmd.scatter, out, ins, group_src=root)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """Reduce-scatter, list form (sizes may differ per destination)."""
        t = one_tensor(output_tensors, "reduce_scatter", "output_tensors", self._spmd.context)
        lst = input_tensors[0] if input_tensors and isinstance(input_tensors[0], (list, tuple)) \
            else input_tensors
        red = reduce_of(opts)
        ins = [host_in(x.clone() if same_storage(x, t) else x, "reduce_scatter",
                       f"input_list[{i}]", self._spmd.context, True) for i, x in enumerate(lst)]
        out = host_out(t, "reduce_scatter", "output", self._spmd.context, True)
        return self._issue(opts, [t], "reduce_scatter", spmd.reduce_scatter, out, ins, red)

    def reduce_scatter_single(self, output, input, opts=None):
        """Reduce-scatter one tensor into equal chunks (``reduce_scatter_tensor``)."""
        if type(opts) is ReduceScatterOptions and not opts.asyncOp and \
                opts.timeout == UNSET_TIMEOUT and self._coalescing is None and \
                opts.reduceOp == SUM_TORCH:
            pair = views.get_pair(output, input)
            if pair is not None and direct.reduce_scatter_tensor(*pair, SUM_SPMD, self._spmd):
                return None
        if same_storage(output, input):
            input = input.clone()
        red = reduce_of(opts)
        a = host_in(input, "reduce_scatter_tensor", "input", self._spmd.context, True)
        out = host_out(output, "reduce_scatter_tensor", "output", self._spmd.context, True)
        return self._issue(opts, [output], "reduce_scatter_tensor", spmd.reduce_scatter_tensor, out, a, red)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        """Several reduce_scatter_tensor calls, fused per dtype."""
        red = reduce_of(opts)
        pairs = []
        for i, (o, x) in enumerate(zip(outputs, inputs)):
            if same_storage(o, x):
                x = x.clone()
            pairs.append((host_out(o, "reduce_scatter_tensor", f"outputs[{i}]", self._spmd.context, True),
                          host_in(x, "reduce_scatter_tensor", f"inputs[{i}]", self._spmd.context, True)))
        with spmd.coalescing_manager(group=self._spmd, async_ops=True) as cm:
            for out, a in pairs:
                spmd.reduce_scatter_tensor(out, a, red, group=self._spmd, async_op=True)
        return self._work(list(cm.works), list(outputs), "reduce_scatter_coalesced", opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """All-to-all, list form (sizes may differ per pair)."""
        ins = [host_in(x.clone() if any(same_storage(x, o) for o in output_tensors) else x,
                       "all_to_all", f"input_tensor_list[{i}]", self._spmd.context)
               for i, x in enumerate(input_tensors)]
        outs = [host_out(o, "all_to_all", f"output_tensor_list[{i}]", self._spmd.context)
                for i, o in enumerate(output_tensors)]
        return self._issue(opts, list(output_tensors), "all_to_all", spmd.all_to_all, outs, ins)

    def all_to_all_single(self, output, input, output_split_sizes=None,
                          input_split_sizes=None, opts=None):
        """All-to-all of one tensor split along dimension 0 (splits optional)."""
        if isinstance(output_split_sizes, AllToAllOptions):  # (output, input, opts)
            opts, output_split_sizes = output_split_sizes, None
        if same_storage(output, input):
            input = input.clone()
        a = host_in(input, "all_to_all_single", "input", self._spmd.context)
        out = host_out(output, "all_to_all_single", "output", self._spmd.context)
        outs = [int(s) for s in output_split_sizes] if output_split_sizes else None
        ins = [int(s) for s in input_split_sizes] if input_split_sizes else None
        return self._issue(opts, [output], "all_to_all_single", spmd.all_to_all_single, out, a, outs, ins)

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        """Every rank of the group enters before any leaves."""
        if type(opts) is BarrierOptions and not opts.asyncOp and not opts.device_ids and \
                opts.timeout == UNSET_TIMEOUT and self._coalescing is None and \
                direct.barrier(self._spmd):
            return None
        return self._issue(opts, [], "barrier", spmd.barrier)

    # -- point to point ---------------------------------------------------------------

    def send(self, tensors, dst_rank: int, tag: int = 0):
        """Start sending to group rank ``dst_rank`` (nonblocking: batches cannot deadlock)."""
        t = one_tensor(tensors, "send", "tensors", self._spmd.context)
        a = host_in(t, "send", "tensor", self._spmd.context)
        w = spmd.isend(a, group_dst=dst_rank, group=self._spmd, tag=tag)
        return self._work([w], [t], "send")

    def recv(self, tensors, src_rank: int, tag: int = 0):
        """Start receiving from group rank ``src_rank``."""
        t = one_tensor(tensors, "recv", "tensors", self._spmd.context)
        a = host_out(t, "recv", "tensor", self._spmd.context)
        w = spmd.irecv(a, group_src=src_rank, group=self._spmd, tag=tag)
        return self._work([w], [t], "recv")

    def recv_anysource(self, tensors, tag: int = 0):
        """Start receiving from any rank; ``_source_rank()`` tells which (group rank)."""
        t = one_tensor(tensors, "recv", "tensors", self._spmd.context)
        a = host_out(t, "recv", "tensor", self._spmd.context)
        w = spmd.irecv(a, group=self._spmd, tag=tag)
        work = self._work([w], [t], "recv")
        work._src_work = w  # the torch Work's spmd receive, for its source rank (_work.py)
        return work

    # -- coalescing (C++ callers and torch's _coalescing_manager with a device) --------

    def start_coalescing(self, device=None) -> None:
        """Collect the Works of the ops that follow, until :meth:`end_coalescing`.

        The ops start as they are issued (spmd's ops are nonblocking), so sends and
        receives of a batch cannot deadlock each other.
        """
        if self._coalescing is not None:
            raise RuntimeError("start_coalescing: this group is already coalescing")
        self._coalescing = []

    def end_coalescing(self, device=None):
        """One Work for everything issued since :meth:`start_coalescing`."""
        works, self._coalescing = self._coalescing or [], None
        return SpmdWork(works, [t for w in works for t in (w.outputs or [])],
                        "coalesced", self._spmd)

    _start_coalescing = start_coalescing
    _end_coalescing = end_coalescing

    # -- lifecycle --------------------------------------------------------------------

    def shutdown(self) -> None:
        """Free the spmd group underneath (WORLD too, when the backend started spmd)."""
        if self._owns == "group":
            if spmd.is_initialized() and self._spmd.context.comm is not None:
                spmd.destroy_process_group(self._spmd)
        elif self._owns == "world" and owns_world() and spmd.is_initialized():
            spmd.destroy_process_group()
            release_world()
        self._owns = ""

    def abort(self) -> None:
        self.shutdown()

    # -- shrinking (torch's dist.shrink_group) ----------------------------------------

    @property
    def supports_shrinking(self) -> bool:
        """torch's ``dist.shrink_group`` asks this: spmd shrinks on any MPI (a planned
        removal) and, on an MPI with ULFM, after ranks died."""
        return True

    def shrink(self, ranks_to_exclude, shrink_flags: int = 0, opts_override=None):
        """The group without ``ranks_to_exclude`` (group ranks): ``spmd.shrink_group`` of
        the spmd group underneath, as a new SpmdProcessGroup that takes over what this
        one owned (torch destroys this one next)."""
        new = spmd.shrink_group(list(ranks_to_exclude), self._spmd, shrink_flags)
        owns, self._owns = self._owns, ""
        _adopt_shrunk_groups()
        return SpmdProcessGroup(new, new.rank(), new.size(), self._timeout, owns)

    # -- reconfiguring (torch 2.14: init_process_group(..., enable_reconfigure=True)) ----

    @property
    def supports_reconfigure(self) -> bool:
        """torch's ``dist._supports_reconfigure`` asks this: the default group rebuilds
        on the processes whose handles it is given (spmd.torch._reconfigure)."""
        return True

    def get_reconfigure_handle(self) -> str:
        """This process's handle, for the others' ``reconfigure`` (a local call)."""
        return reconfigure_handle(self)

    def reconfigure(self, opts):
        """Rebuild the default group on the processes ``opts.handles`` names: torch's
        default group is a new object afterwards (spmd.torch._reconfigure)."""
        return reconfigure_default(self, opts)


# The ops torch calls: an op that refuses to start (its group failed, broke, timed out
# before) raises spmd's error as torch's DistBackendError (spmd.torch._errors), as the
# Work of an op that started does.
TORCH_OPS = ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather",
             "all_gather_single", "_allgather_base", "all_gather_single_coalesced",
             "allgather_into_tensor_coalesced", "allgather_coalesced", "gather", "scatter",
             "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base",
             "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
             "alltoall", "all_to_all_single", "alltoall_base", "barrier", "send", "recv",
             "recv_anysource", "end_coalescing", "_end_coalescing", "shrink")
for _name in TORCH_OPS:
    setattr(SpmdProcessGroup, _name, raising_torch_errors(vars(SpmdProcessGroup)[_name]))


def _keep_excepthook_output() -> None:
    """Make the hook in place (spmd's: print the traceback, then abort the job) write to
    the real stderr.  torch wraps it next and hands it a StringIO it prints only after
    the hook returns, which an aborting hook never does: the traceback would be lost."""
    prev = sys.excepthook

    def hook(*args):
        saved, sys.stderr = sys.stderr, sys.__stderr__
        try:
            prev(*args)
        finally:
            sys.stderr = saved

    sys.excepthook = hook


_torch_make_shrunk = None   # torch's _create_shrunk_process_group, once replaced


def _adopt_shrunk_groups() -> None:
    """torch's ``shrink_group`` registers the backend's new group in a fresh C++
    ProcessGroup (``_register_backend``), which takes a C++ ``Backend`` only; an
    SpmdProcessGroup is a whole ProcessGroup already, so it is used as it is.  Put in
    place at the first shrink of an spmd group; every other backend's shrink goes to
    torch's own function unchanged."""
    global _torch_make_shrunk
    c10d = dist.distributed_c10d
    if _torch_make_shrunk is not None:
        return
    _torch_make_shrunk = c10d._create_shrunk_process_group  # torch's step to wrap (above)

    def make_shrunk(new_backend, remaining_ranks, metadata, is_default_group):
        if not isinstance(new_backend, SpmdProcessGroup):
            return _torch_make_shrunk(new_backend, remaining_ranks, metadata,
                                      is_default_group)
        new_backend.setGroupName(metadata["new_group_name"])
        new_backend.setGroupDesc("default:shrunken" if is_default_group
                                 else f"{metadata['original_group_name']}:shrunk")
        return new_backend

    c10d._create_shrunk_process_group = make_shrunk  # the one place torch makes that group


def _cpu_only(pg) -> bool:
    return isinstance(pg, SpmdProcessGroup) and _CUDA not in pg._device_types


def create(opts, pg_options) -> SpmdProcessGroup:
    """torch's creator for the spmd backend (``Backend.register_backend(extended_api=True)``).

    The default group wraps spmd's WORLD (spmd is initialised here if it is not yet);
    a subgroup is ``spmd.new_group`` of its global ranks, in torch's group-rank order,
    which only the members call, as torch only calls the creator on members.

    Raises:
        RuntimeError: torch's ranks disagree with MPI's (the job was not started by an
            MPI launcher, or by one that spmd's MPI does not match).
    """
    answer_device_without_shards(_cpu_only)
    timeout = opts.timeout if isinstance(opts.timeout, timedelta) else None
    settings = pg_options if isinstance(pg_options, dict) else None
    owned_before = spmd.is_initialized()
    ensure_spmd(timeout, settings)
    ranks = list(opts.global_ranks_in_group)
    world = spmd.GroupMember.WORLD
    n, me = spmd.get_world_size(), spmd.get_rank()
    if not ranks:
        if opts.group_size != n or opts.group_rank != me:
            raise RuntimeError(
                f"spmd backend: torch says rank {opts.group_rank} of {opts.group_size} but MPI "
                f"says rank {me} of {n}; start the job with mpiexec or srun (not torchrun), "
                "and leave RANK/WORLD_SIZE unset or equal to MPI's")
        owns = "world" if not owned_before or owns_world() else ""
        _keep_excepthook_output()
        assert world is not None  # ensure_spmd() initialised spmd
        pg = SpmdProcessGroup(world, me, n, timeout, owns)
        if getattr(opts, "enable_reconfigure", False):   # torch 2.14 and later
            enable_reconfigure(pg, opts.store, timeout)
        return pg
    if max(ranks) >= n:
        raise RuntimeError(f"spmd backend: group of global ranks {ranks} but the MPI job has "
                           f"{n} ranks [rank {me}]")
    group = spmd.new_group(ranks, timeout=timeout, sort_ranks=False)
    # torch makes a backend only on the group's members, which get a ProcessGroup
    assert isinstance(group, spmd.ProcessGroup)
    if group.rank() != opts.group_rank:
        raise RuntimeError(f"spmd backend: group rank {group.rank()} from MPI but "
                           f"{opts.group_rank} from torch for ranks {ranks} [rank {me}]")
    return SpmdProcessGroup(group, opts.group_rank, opts.group_size, timeout, "group")
