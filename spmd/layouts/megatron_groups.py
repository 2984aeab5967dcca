"""Megatron's groups, built: the sizes checked, the decoder's and the expert layers'
meshes split, their combined groups flattened, and the embedding groups made.

:func:`~spmd.layouts.parallel_state.initialize_model_parallel` calls :func:`build` and
keeps what it returns as the process's model-parallel layout.  Every check is made
before the first split, so a wrong argument raises on every rank alike and leaves no
group behind; from there on every rank of WORLD splits (one ``Comm.Split`` per kind of
group).  Where the ranks go: ``spmd.layouts.megatron_layout``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from spmd.layouts import megatron_layout as ml
from spmd.layouts.mesh import DeviceMesh
from spmd.runtime.group import ProcessGroup, new_subgroups_by_enumeration

__all__ = ["ModelParallelLayout", "RanksFn", "build"]

RanksFn = Callable[[list[int]], list[int]]  # pipeline ranks -> embedding ranks


class ModelParallelLayout:
    """What :func:`build` made: meshes and groups by Megatron token, and the arguments
    that build it again."""

    def __init__(self, world: ProcessGroup, decoder: DeviceMesh, expert: DeviceMesh,
                 groups: dict[str, ProcessGroup | None], embedding: dict[str, list[int] | None],
                 virtual_pipeline_size: int | None, arguments: dict):
        self.world = world
        self.decoder = decoder
        self.expert = expert
        self.groups = groups
        self.embedding = embedding  # "embd"/"pos-embd": this rank's list as the rule gave it
        self.virtual_pipeline_size = virtual_pipeline_size
        self.arguments = arguments  # initialize_model_parallel's, checked


def build(world: ProcessGroup, op: str, *, tensor_model_parallel_size: int,
          pipeline_model_parallel_size: int, context_parallel_size: int,
          expert_model_parallel_size: int, order: str,
          expert_tensor_parallel_size: int | None,
          virtual_pipeline_model_parallel_size: int | None,
          get_embedding_ranks: RanksFn | None, get_position_embedding_ranks: RanksFn | None,
          distributed_timeout_minutes: float | None) -> ModelParallelLayout:
    """Check the sizes against ``world``, then build every group of the layout.

    Every rank of WORLD must call it with the same arguments (those of
    ``initialize_model_parallel``, whose docstring says what they mean and what raises).
    """
    tp = ml.positive(tensor_model_parallel_size, "tensor_model_parallel_size", op)
    pp = ml.positive(pipeline_model_parallel_size, "pipeline_model_parallel_size", op)
    cp = ml.positive(context_parallel_size, "context_parallel_size", op)
    ep = ml.positive(expert_model_parallel_size, "expert_model_parallel_size", op)
    etp = tp if expert_tensor_parallel_size is None else ml.positive(
        expert_tensor_parallel_size, "expert_tensor_parallel_size", op)
    vp = virtual_pipeline_model_parallel_size
    if vp is not None:
        vp = ml.positive(vp, "virtual_pipeline_model_parallel_size", op)
        if pp <= 1:  # Megatron's check and exception type
            raise RuntimeError(f"{op}: virtual_pipeline_model_parallel_size ({vp}) needs "
                               f"pipeline_model_parallel_size > 1, got {pp}")
    n = world.context.size
    if n % (tp * pp * cp):
        raise ValueError(f"{op}: world size {n} is not divisible by tensor_model_parallel_size "
                         f"({tp}) x pipeline_model_parallel_size ({pp}) x context_parallel_size "
                         f"({cp}) = {tp * pp * cp}")
    if n % (etp * ep * pp):
        raise ValueError(f"{op}: world size {n} is not divisible by expert_tensor_parallel_size "
                         f"({etp}) x expert_model_parallel_size ({ep}) x "
                         f"pipeline_model_parallel_size ({pp}) = {etp * ep * pp}")
    dp, edp = n // (tp * pp * cp), n // (etp * ep * pp)
    decoder_sizes = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": 1}
    expert_sizes = {"tp": etp, "pp": pp, "dp": edp, "cp": 1, "ep": ep}
    full_order = ml.full_order(order, decoder_sizes, op)
    ml.full_order(order, expert_sizes, op)
    if not (full_order[-1] == "pp" or pp == 1 or edp == dp):
        raise ValueError(f"{op}: with order {order!r} (pp not last), the expert data-parallel "
                         f"size ({edp}) must equal the data-parallel size ({dp})")
    timeout = None
    if distributed_timeout_minutes is not None:
        timeout = timedelta(minutes=float(distributed_timeout_minutes))

    decoder_pp, expert_pp = ml.pp_lines(full_order, decoder_sizes), ml.pp_lines(full_order, expert_sizes)
    if decoder_pp != expert_pp:
        raise ValueError(f"{op}: the pipeline groups of the expert layout {expert_pp} differ "
                         f"from the decoder's {decoder_pp}; use an order that ends with 'pp'")
    embd = ml.embedding_lists(decoder_pp, get_embedding_ranks or ml.default_embedding_ranks,
                              "get_embedding_ranks", n, op)
    pos_embd = ml.embedding_lists(decoder_pp, get_position_embedding_ranks
                                  or ml.default_position_embedding_ranks,
                                  "get_position_embedding_ranks", n, op)
    # Every check is done: from here on every rank splits.
    decoder = ml.layout_mesh(full_order, decoder_sizes, "ep", {}, timeout)
    expert_names = {"tp": "etp", "dp": "edp"}
    groups: dict[str, ProcessGroup | None] = {
        "tp": decoder.get_group("tp"),
        "pp": decoder.get_group("pp"),
        "dp": decoder.get_group("dp"),
        "cp": decoder.get_group("cp"),
        "dp-cp": ml.flat_group(decoder, ["dp", "cp"], "dp_cp"),
        "tp-pp": ml.flat_group(decoder, ["tp", "pp"], "mp"),
        "tp-cp": ml.flat_group(decoder, ["tp", "cp"], "tp_cp"),
        "tp-dp": ml.flat_group(decoder, ["tp", "dp"], "tp_dp"),
        "tp-dp-cp": ml.flat_group(decoder, ["tp", "dp", "cp"], "tp_dp_cp"),
    }
    expert = ml.layout_mesh(full_order, expert_sizes, "cp", expert_names, timeout,
                          given={"pp": groups["pp"]})
    groups.update({
        "ep": expert.get_group("ep"),
        "etp": expert.get_group("etp"),
        "edp": expert.get_group("edp"),
        "etp-ep": ml.flat_group(expert, ["etp", "ep"], "etp_ep"),
        "etp-ep-pp": ml.flat_group(expert, ["etp", "ep", "pp"], "etp_ep_pp"),
    })
    mine = {}
    for token, lists, desc in (("embd", embd, "embedding"), ("pos-embd", pos_embd,
                                                               "position_embedding")):
        groups[token], _ = new_subgroups_by_enumeration(lists, timeout=timeout, group_desc=desc)
        mine[token] = next((r for r in lists if world.context.rank in r), None)
    arguments = dict(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        context_parallel_size=cp, expert_model_parallel_size=ep, order=order,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        virtual_pipeline_model_parallel_size=vp, get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
        distributed_timeout_minutes=distributed_timeout_minutes)
    return ModelParallelLayout(world, decoder, expert, groups, mine, vp, arguments)
