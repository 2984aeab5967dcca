"""Public collectives, with torch.distributed's names, arguments and semantics.

Each function checks its arguments on the calling rank (before anything is sent),
then hands validated arrays to the group's backend for their device, which starts
nonblocking work.  ``async_op=True`` returns the Work; otherwise the call waits and
returns None.  A rank that is not in ``group`` gets a warning and None, as in torch.

Every rank of the group must make the same collective calls in the same order, with
matching roots, dtypes, reduce ops and sizes; what one rank cannot see locally (a
peer passing another shape) is caught by debug mode, not here.
"""

from __future__ import annotations

from collections.abc import Sequence

from spmd.backends.mpi.fastcall import direct, host_arrays
from spmd.core.arrays import (
    array_in,
    array_list,
    array_out,
    common_device,
    same_dtype,
    same_size,
)
from spmd.core.context import GroupContext
from spmd.core.errors import located
from spmd.core.futures import Future
from spmd.core.ops import ReduceOp
from spmd.core.typing import Array, Timeout
from spmd.core.work import Work
from spmd.runtime.group import GroupArg, ProcessGroup, resolve
from spmd.runtime.world import Backend

__all__ = [
    "broadcast",
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
]


_SUM = ReduceOp.SUM

def group_rank_of(pg: ProcessGroup, op: str, rank, group_rank, arg: str) -> int | None:
    """The group rank named by a global rank (``src``/``dst``/``peer``) or by a group rank
    (``group_src``/...): at most one may be given; None if neither is."""
    if group_rank is not None:
        if rank is not None:
            raise located(ValueError, op, f"give either {arg} or group_{arg}, not both "
                          f"(got {arg}={rank}, group_{arg}={group_rank})", pg.context)
        if isinstance(group_rank, bool) or not isinstance(group_rank, int):
            raise located(TypeError, op, f"group_{arg} must be an int, got "
                          f"{type(group_rank).__name__}", pg.context)
        if not 0 <= group_rank < pg.context.size:
            raise located(ValueError, op, f"group_{arg}={group_rank} is out of range "
                          f"[0, {pg.context.size})", pg.context)
        return group_rank
    if rank is None:
        return None
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise located(TypeError, op, f"{arg} must be an int (a global rank), got "
                      f"{type(rank).__name__}", pg.context)
    r = pg.context.group_rank(rank)
    if r < 0:
        raise located(ValueError, op, f"{arg}={rank} is not a member of the group "
                      f"(global ranks {list(pg.context.ranks)})", pg.context)
    return r


def root_rank(pg: ProcessGroup, op: str, root, group_root, arg: str, default: int | None = None) -> int:
    """The group rank of a collective's root; with neither form given, the global rank
    ``default`` where torch has one (gather, scatter and the object collectives use
    global rank 0)."""
    if group_root is None and type(root) is int:  # the common case: one lookup
        r = pg.context.index.get(root, -1)
        if r >= 0:
            return r
    if root is None and group_root is None:
        root = default
    given = group_rank_of(pg, op, root, group_root, arg)
    if given is None:
        raise located(ValueError, op, f"{arg} (a global rank) or group_{arg} (a group rank) "
                      "must be given", pg.context)
    return given


def _root_list(arrays, ref, is_root: bool, op: str, arg: str, role: str, out: bool, pg: ProcessGroup):
    """The per-rank list of gather/scatter: required on the root, None or empty elsewhere."""
    if not is_root:
        if arrays:
            raise located(ValueError, op, f"{arg} must be None or empty on ranks other than the "
                          f"{role}", pg.context)
        return None
    if arrays is None:
        raise located(ValueError, op, f"{arg} is required on the {role} rank", pg.context)
    checked = array_list(arrays, op, arg, pg.context, pg.context.size, out=out)
    same_dtype(checked, ref, op, arg, "tensor", pg.context)
    same_size(checked, ref, op, arg, "tensor", pg.context)
    return checked


def _split_counts(splits, n: int, rows: int, row_size: int, op: str, arg: str, pg: ProcessGroup) -> list[int]:
    if not isinstance(splits, (list, tuple)):
        raise located(TypeError, op, f"{arg} must be a list of ints, got {type(splits).__name__}", pg.context)
    if len(splits) != n:
        raise located(ValueError, op, f"{arg} has {len(splits)} entries, expected {n} "
                      "(the group size)", pg.context)
    for s in splits:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise located(ValueError, op, f"{arg} must hold non-negative ints, got {list(splits)}", pg.context)
    if sum(splits) != rows:
        raise located(ValueError, op, f"{arg} adds up to {sum(splits)}, expected {rows} "
                      "(the array's first dimension)", pg.context)
    return [s * row_size for s in splits]


def _one_per_rank(xs, ref, op: str, arg: str, ref_arg: str, out: bool,
                  ctx: GroupContext) -> list:
    """``xs`` as one array per rank of the group, of ``ref``'s dtype, this rank's own of
    ``ref``'s size (all_gather's outputs, reduce_scatter's inputs)."""
    arrays = array_list(xs, op, arg, ctx, ctx.size, out=out)
    same_dtype(arrays, ref, op, arg, ref_arg, ctx)
    if arrays[ctx.rank].size != ref.size:
        raise located(ValueError, op, f"{arg}[{ctx.rank}] has {arrays[ctx.rank].size} elements, "
                      f"expected {ref.size} (the size of {ref_arg} on this rank)", ctx)
    return arrays


def broadcast(tensor: Array, src: int | None = None, group: GroupArg = None,
              async_op: bool = False, group_src: int | None = None) -> Work | None:
    """Copy ``tensor`` from rank ``src`` into ``tensor`` on every rank of the group."""
    if not async_op and direct.broadcast(tensor, src, group, group_src):
        return None   # the compiled path ran it (see spmd.backends.mpi.fastcall.direct)
    pg = resolve(group, "broadcast")
    if pg is None:
        return None
    root = root_rank(pg, "broadcast", src, group_src, "src")
    a, dev = array_out(tensor, "broadcast", "tensor", pg.context)
    return pg.engines[dev].run("broadcast", async_op, a, root)


def all_reduce(tensor: Array, op: ReduceOp = _SUM, group: GroupArg = None,
               async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` across the group with ``op``; every rank gets the result in place."""
    if not async_op and direct.all_reduce(tensor, op, group):
        return None
    pg = resolve(group, "all_reduce")
    if pg is None:
        return None
    a, dev = array_out(tensor, "all_reduce", "tensor", pg.context)
    return pg.engines[dev].run("all_reduce", async_op, a, op)


def all_reduce_coalesced(tensors: Sequence[Array], op: ReduceOp = _SUM, group: GroupArg = None,
                         async_op: bool = False) -> Future | None:
    """All-reduce every array of ``tensors`` in place, packed into one call per dtype.

    With ``async_op=True`` it returns a Future (as torch does) whose value is ``tensors``.
    """
    pg = resolve(group, "all_reduce_coalesced")
    if pg is None:
        return None
    if host_arrays(tensors):   # the training-loop case, checked in one C call
        dev, arrays = "cpu", list(tensors)
    else:
        dev = common_device("all_reduce_coalesced", pg.context, ("tensors", tensors))
        arrays = array_list(tensors, "all_reduce_coalesced", "tensors", pg.context, None,
                            out=True)
    if not arrays:
        raise located(ValueError, "all_reduce_coalesced", "tensors is empty", pg.context)
    work = pg.engines[dev].run("all_reduce_coalesced", async_op, arrays, op)
    # torch returns the Future here, not the Work: its value is the list of arrays.
    return work.get_future() if async_op else None


def reduce(tensor: Array, dst: int | None = None, op: ReduceOp = _SUM, group: GroupArg = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None:
    """Reduce ``tensor`` across the group into ``tensor`` on rank ``dst`` only."""
    if not async_op and direct.reduce(tensor, dst, op, group, group_dst):
        return None
    pg = resolve(group, "reduce")
    if pg is None:
        return None
    root = root_rank(pg, "reduce", dst, group_dst, "dst")
    a, dev = (array_out if pg.context.rank == root else array_in)(tensor, "reduce", "tensor",
                                                                   pg.context)
    return pg.engines[dev].run("reduce", async_op, a, root, op)


def all_gather(tensor_list: Sequence[Array], tensor: Array, group: GroupArg = None,
               async_op: bool = False) -> Work | None:
    """Gather every rank's ``tensor`` into ``tensor_list`` on every rank.

    Sizes may differ between ranks: ``tensor_list[i]`` must have rank i's size.
    """
    pg = resolve(group, "all_gather")
    if pg is None:
        return None
    dev = common_device("all_gather", pg.context, ("tensor", tensor), ("tensor_list", tensor_list))
    a, _ = array_in(tensor, "all_gather", "tensor", pg.context)
    outs = _one_per_rank(tensor_list, a, "all_gather", "tensor_list", "tensor", True, pg.context)
    return pg.engines[dev].run("all_gather", async_op, outs, a)


def all_gather_into_tensor(output_tensor: Array, input_tensor: Array, group: GroupArg = None,
                           async_op: bool = False) -> Work | None:
    """Gather every rank's ``input_tensor`` into ``output_tensor``, in rank order.

    The output is the inputs concatenated along dimension 0 (shape ``[n*d0, ...]``) or
    stacked (``[n, d0, ...]``); any shape with ``n`` times the input's elements works.
    """
    if not async_op and direct.all_gather_into_tensor(output_tensor, input_tensor, group):
        return None
    pg = resolve(group, "all_gather_into_tensor")
    if pg is None:
        return None
    if type(output_tensor) is not type(input_tensor):   # raises if host and device are mixed
        common_device("all_gather_into_tensor", pg.context, ("output_tensor", output_tensor),
                      ("input_tensor", input_tensor))
    a, dev = array_in(input_tensor, "all_gather_into_tensor", "input_tensor", pg.context)
    out, _ = array_out(output_tensor, "all_gather_into_tensor", "output_tensor", pg.context)
    if out.dtype != a.dtype:
        raise located(TypeError, "all_gather_into_tensor", f"output_tensor has dtype {out.dtype}, "
                      f"expected {a.dtype} (the dtype of input_tensor)", pg.context)
    if out.size != pg.context.size * a.size:
        raise located(ValueError, "all_gather_into_tensor", f"output_tensor has {out.size} "
                      f"elements, expected world_size ({pg.context.size}) x input ({a.size}) = "
                      f"{pg.context.size * a.size}", pg.context)
    return pg.engines[dev].run("all_gather_into_tensor", async_op, out, a)


def all_gather_coalesced(output_tensor_lists: Sequence[Sequence[Array]],
                         input_tensor_list: Sequence[Array], group: GroupArg = None,
                         async_op: bool = False) -> Future | None:
    """All-gather a list of arrays in one call: ``output_tensor_lists[i][j]`` receives
    rank i's ``input_tensor_list[j]``.

    With ``async_op=True`` it returns a Future (as torch does) whose value is
    ``output_tensor_lists``.
    """
    op = "all_gather_coalesced"
    pg = resolve(group, op)
    if pg is None:
        return None
    nested = output_tensor_lists if isinstance(output_tensor_lists, (list, tuple)) else ()
    dev = common_device(op, pg.context, ("input_tensor_list", input_tensor_list),
                        *((f"output_tensor_lists[{i}]", x) for i, x in enumerate(nested)))
    ins = array_list(input_tensor_list, op, "input_tensor_list", pg.context, None, out=False)
    if not isinstance(output_tensor_lists, (list, tuple)) or len(output_tensor_lists) != pg.context.size:
        got = len(output_tensor_lists) if isinstance(output_tensor_lists, (list, tuple)) else \
            type(output_tensor_lists).__name__
        raise located(ValueError, op, f"output_tensor_lists must be a list of {pg.context.size} lists "
                      f"(the group size), got {got}", pg.context)
    outs = []
    for i, lst in enumerate(output_tensor_lists):
        arrays = array_list(lst, op, f"output_tensor_lists[{i}]", pg.context, len(ins), out=True)
        for j, (o, x) in enumerate(zip(arrays, ins)):
            if o.dtype != x.dtype or o.size != x.size:
                raise located(ValueError, op, f"output_tensor_lists[{i}][{j}] is {o.dtype} with "
                              f"{o.size} elements, expected {x.dtype} with {x.size} (like "
                              f"input_tensor_list[{j}])", pg.context)
        outs.append(arrays)
    work = pg.engines[dev].run(op, async_op, outs, ins)
    # torch returns the Future here: its value is output_tensor_lists.
    return work.get_future() if async_op else None


def gather(tensor: Array, gather_list: Sequence[Array] | None = None, dst: int | None = None,
           group: GroupArg = None, async_op: bool = False,
           group_dst: int | None = None) -> Work | None:
    """Gather every rank's ``tensor`` into ``gather_list`` on rank ``dst``.

    ``gather_list`` must hold one array per rank on ``dst`` and be None (or empty)
    elsewhere.
    """
    pg = resolve(group, "gather")
    if pg is None:
        return None
    root = root_rank(pg, "gather", dst, group_dst, "dst", default=0)
    dev = common_device("gather", pg.context, ("tensor", tensor), ("gather_list", gather_list))
    a, _ = array_in(tensor, "gather", "tensor", pg.context)
    outs = _root_list(gather_list, a, pg.context.rank == root, "gather", "gather_list", "destination",
                      True, pg)
    return pg.engines[dev].run("gather", async_op, a, outs, root)


def scatter(tensor: Array, scatter_list: Sequence[Array] | None = None, src: int | None = None,
            group: GroupArg = None, async_op: bool = False,
            group_src: int | None = None) -> Work | None:
    """Send ``scatter_list[i]`` from rank ``src`` into ``tensor`` on group rank i.

    ``scatter_list`` must hold one array per rank on ``src`` and be None (or empty)
    elsewhere.
    """
    pg = resolve(group, "scatter")
    if pg is None:
        return None
    root = root_rank(pg, "scatter", src, group_src, "src", default=0)
    dev = common_device("scatter", pg.context, ("tensor", tensor), ("scatter_list", scatter_list))
    out, _ = array_out(tensor, "scatter", "tensor", pg.context)
    ins = _root_list(scatter_list, out, pg.context.rank == root, "scatter", "scatter_list", "source",
                     False, pg)
    return pg.engines[dev].run("scatter", async_op, out, ins, root)


def reduce_scatter(output: Array, input_list: Sequence[Array], op: ReduceOp = _SUM,
                   group: GroupArg = None, async_op: bool = False) -> Work | None:
    """Reduce ``input_list[i]`` across the group into ``output`` on group rank i.

    Sizes may differ by destination: ``input_list[i]`` must have the size of rank i's
    ``output`` on every rank.
    """
    pg = resolve(group, "reduce_scatter")
    if pg is None:
        return None
    dev = common_device("reduce_scatter", pg.context, ("output", output), ("input_list", input_list))
    out, _ = array_out(output, "reduce_scatter", "output", pg.context)
    ins = _one_per_rank(input_list, out, "reduce_scatter", "input_list", "output", False, pg.context)
    return pg.engines[dev].run("reduce_scatter", async_op, out, ins, op)


def reduce_scatter_tensor(output: Array, input: Array, op: ReduceOp = _SUM,  # noqa: A002
                          group: GroupArg = None, async_op: bool = False) -> Work | None:
    """Reduce ``input`` across the group and scatter it: group rank i gets the i-th of
    ``n`` equal chunks (along dimension 0) in ``output``."""
    if not async_op and direct.reduce_scatter_tensor(output, input, op, group):
        return None
    pg = resolve(group, "reduce_scatter_tensor")
    if pg is None:
        return None
    if type(output) is not type(input):   # raises if host and device are mixed
        common_device("reduce_scatter_tensor", pg.context, ("output", output), ("input", input))
    out, dev = array_out(output, "reduce_scatter_tensor", "output", pg.context)
    a, _ = array_in(input, "reduce_scatter_tensor", "input", pg.context)
    if out.dtype != a.dtype:
        raise located(TypeError, "reduce_scatter_tensor", f"output has dtype {out.dtype}, "
                      f"expected {a.dtype} (the dtype of input)", pg.context)
    if a.size != pg.context.size * out.size:
        raise located(ValueError, "reduce_scatter_tensor", f"input has {a.size} elements, "
                      f"expected world_size ({pg.context.size}) x output ({out.size}) = "
                      f"{pg.context.size * out.size}", pg.context)
    return pg.engines[dev].run("reduce_scatter_tensor", async_op, out, a, op)


def all_to_all(output_tensor_list: Sequence[Array], input_tensor_list: Sequence[Array],
               group: GroupArg = None, async_op: bool = False) -> Work | None:
    """Send ``input_tensor_list[i]`` to group rank i; receive rank i's into
    ``output_tensor_list[i]``.  Sizes may differ per pair."""
    pg = resolve(group, "all_to_all")
    if pg is None:
        return None
    dev = common_device("all_to_all", pg.context, ("output_tensor_list", output_tensor_list),
                        ("input_tensor_list", input_tensor_list))
    ins = array_list(input_tensor_list, "all_to_all", "input_tensor_list", pg.context, pg.context.size, out=False)
    outs = array_list(output_tensor_list, "all_to_all", "output_tensor_list", pg.context, pg.context.size, out=True)
    same_dtype(ins, outs[0], "all_to_all", "input_tensor_list", "output_tensor_list[0]", pg.context)
    same_dtype(outs, outs[0], "all_to_all", "output_tensor_list", "output_tensor_list[0]", pg.context)
    if ins[pg.context.rank].size != outs[pg.context.rank].size:
        raise located(ValueError, "all_to_all", f"input_tensor_list[{pg.context.rank}] has "
                      f"{ins[pg.context.rank].size} elements but output_tensor_list[{pg.context.rank}] has "
                      f"{outs[pg.context.rank].size}; this rank sends the one to itself into the other", pg.context)
    return pg.engines[dev].run("all_to_all", async_op, outs, ins)


def all_to_all_single(output: Array, input: Array,  # noqa: A002
                      output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None,
                      group: GroupArg = None, async_op: bool = False) -> Work | None:
    """Split ``input`` along dimension 0, send piece i to group rank i, and concatenate
    what arrives into ``output``.

    Without split sizes the first dimension is split into equal parts (it must be
    divisible by the group size); with them, ``input_split_sizes[i]`` rows go to rank i
    and ``output_split_sizes[i]`` rows come from it.
    """
    if not async_op and direct.all_to_all_single(output, input, output_split_sizes,
                                                 input_split_sizes, group):
        return None
    op = "all_to_all_single"
    pg = resolve(group, op)
    if pg is None:
        return None
    if type(output) is not type(input):   # raises if host and device are mixed
        common_device(op, pg.context, ("output", output), ("input", input))
    a, dev = array_in(input, op, "input", pg.context)
    out, _ = array_out(output, op, "output", pg.context)
    n = pg.context.size
    if out.dtype != a.dtype:
        raise located(TypeError, op, f"output has dtype {out.dtype}, expected {a.dtype} "
                      "(the dtype of input)", pg.context)
    if a.ndim == 0 or out.ndim == 0:
        raise located(ValueError, op, "input and output need at least one dimension to split", pg.context)
    in_row, out_row = _row_size(a), _row_size(out)
    if in_row != out_row:
        raise located(ValueError, op, f"rows of input have {in_row} elements but rows of output "
                      f"have {out_row}; they must match", pg.context)
    if output_split_sizes is None and input_split_sizes is None:
        if a.shape[0] % n:
            raise located(ValueError, op, f"input's first dimension ({a.shape[0]}) is not "
                          f"divisible by the group size ({n}); pass split sizes", pg.context)
        if out.size != a.size:
            raise located(ValueError, op, f"output has {out.size} elements, expected {a.size} "
                          "(like input, without split sizes)", pg.context)
        in_counts = out_counts = None
    else:
        if input_split_sizes is None:
            if a.shape[0] % n:
                raise located(ValueError, op, f"input's first dimension ({a.shape[0]}) is not "
                              f"divisible by the group size ({n}); pass input_split_sizes", pg.context)
            input_split_sizes = [a.shape[0] // n] * n
        if output_split_sizes is None:
            if out.shape[0] % n:
                raise located(ValueError, op, f"output's first dimension ({out.shape[0]}) is not "
                              f"divisible by the group size ({n}); pass output_split_sizes", pg.context)
            output_split_sizes = [out.shape[0] // n] * n
        in_counts = _split_counts(input_split_sizes, n, a.shape[0], in_row, op,
                                  "input_split_sizes", pg)
        out_counts = _split_counts(output_split_sizes, n, out.shape[0], out_row, op,
                                   "output_split_sizes", pg)
        if in_counts[pg.context.rank] != out_counts[pg.context.rank]:
            raise located(ValueError, op, f"input_split_sizes[{pg.context.rank}] "
                          f"({input_split_sizes[pg.context.rank]}) != output_split_sizes[{pg.context.rank}] "
                          f"({output_split_sizes[pg.context.rank]}): this rank sends that piece to itself", pg.context)
    return pg.engines[dev].run(op, async_op, out, a, out_counts, in_counts)


def _row_size(a) -> int:
    size = 1
    for d in a.shape[1:]:
        size *= d
    return size


def _barrier_device(pg: ProcessGroup, device_ids) -> str:
    """MPI's barrier when the group has a host backend (or device_ids is empty), else the
    GPU backend's (a group made with backend="nccl" has only that)."""
    devices = Backend.device_map(pg.context.backend_name)
    if "cpu" in devices and not device_ids:
        return "cpu"
    return "cuda" if "cuda" in devices else "cpu"


def barrier(group: GroupArg = None, async_op: bool = False,
            device_ids: Sequence[int] | None = None,
            timeout: Timeout | None = None) -> Work | None:
    """Block until every rank of the group has entered the barrier.

    Args:
        timeout: how long to wait (the group's timeout if None).
    """
    if not async_op and device_ids is None and timeout is None and direct.barrier(group):
        return None
    pg = resolve(group, "barrier")
    if pg is None:
        return None
    engine = pg.engines[_barrier_device(pg, device_ids)]
    if timeout is None:
        return engine.run("barrier", async_op)
    work = engine.run("barrier", True)   # a wait of its own length
    if async_op:
        return work
    work.wait(timeout)
    return None
