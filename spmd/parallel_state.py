"""Megatron-style model-parallel groups: tensor, pipeline, data, context and expert.

``initialize_model_parallel`` lays the world out as Megatron-LM's ``RankGenerator``
does and builds every group on :class:`spmd.DeviceMesh`: the ``order`` string lists
the axes fastest-varying first, so the mesh shape is that list reversed (row-major).
Each kind of group costs one ``Comm.Split``, whatever the number of groups.  Group
ranks are the sorted global ranks, exactly Megatron's rank lists.

Differences from Megatron-LM: no virtual pipeline, embedding, Gloo or hierarchical
groups; getters raise RuntimeError (not AssertionError) before initialisation; group
timeouts default to WORLD's.
"""

from __future__ import annotations

import math
from datetime import timedelta

import numpy as np

from .group import GroupMember, ProcessGroup
from .group import world_state as _world_state
from .mesh import DeviceMesh

__all__ = [
    "destroy_model_parallel",
    "get_context_parallel_global_ranks",
    "get_context_parallel_group",
    "get_context_parallel_rank",
    "get_context_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_src_rank",
    "get_data_parallel_world_size",
    "get_expert_data_parallel_group",
    "get_expert_data_parallel_rank",
    "get_expert_data_parallel_world_size",
    "get_expert_model_parallel_group",
    "get_expert_model_parallel_rank",
    "get_expert_model_parallel_world_size",
    "get_expert_tensor_and_model_parallel_group",
    "get_expert_tensor_and_model_parallel_rank",
    "get_expert_tensor_and_model_parallel_world_size",
    "get_expert_tensor_model_pipeline_parallel_group",
    "get_expert_tensor_parallel_group",
    "get_expert_tensor_parallel_rank",
    "get_expert_tensor_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_src_rank",
    "get_model_parallel_world_size",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_tensor_and_context_parallel_group",
    "get_tensor_and_context_parallel_rank",
    "get_tensor_and_context_parallel_world_size",
    "get_tensor_and_data_parallel_group",
    "get_tensor_and_data_parallel_rank",
    "get_tensor_and_data_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "initialize_model_parallel",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "model_parallel_is_initialized",
]

_AXES = ("tp", "pp", "dp", "ep", "cp")  # Megatron's order of appending missing axes


class _Layout:
    """What initialize_model_parallel built: meshes and groups by Megatron token."""

    def __init__(self, world: ProcessGroup, decoder: DeviceMesh, expert: DeviceMesh,
                 groups: dict[str, ProcessGroup]):
        self.world = world
        self.decoder = decoder
        self.expert = expert
        self.groups = groups


_layout: _Layout | None = None


def _positive(value, arg: str, op: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{op}: {arg} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{op}: {arg} must be positive, got {value}")
    return int(value)


def _full_order(order, sizes: dict[str, int], op: str) -> list[str]:
    """The axes fastest first: ``order``'s tokens, then size-1 axes it leaves out."""
    if not isinstance(order, str):
        raise TypeError(f"{op}: order must be a str like 'tp-cp-ep-dp-pp', got "
                        f"{type(order).__name__}")
    tokens = order.lower().split("-")
    for t in tokens:
        if t not in _AXES:
            raise ValueError(f"{op}: order {order!r} has unknown axis {t!r}; expected axes from "
                             f"{_AXES} joined by '-'")
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"{op}: order {order!r} names an axis twice")
    for t in _AXES:
        if t not in tokens:
            if sizes[t] != 1:
                raise ValueError(f"{op}: the {t} size is {sizes[t]} but order {order!r} does not "
                                 f"place {t!r}")
            tokens.append(t)
    return tokens


def _axes(order: list[str], drop: str) -> list[str]:
    """Mesh dimensions: the order reversed (slowest first), without size-1 axis ``drop``."""
    return [t for t in reversed(order) if t != drop]


def _layout_mesh(order: list[str], sizes: dict[str, int], drop: str, names: dict[str, str],
                 timeout, given=None) -> DeviceMesh:
    axes = _axes(order, drop)
    full = np.arange(math.prod(sizes[t] for t in axes)).reshape([sizes[t] for t in axes])
    groups = [(given or {}).get(t) for t in axes]
    return DeviceMesh._with_groups("cpu", full, tuple(names.get(t, t) for t in axes), groups,
                                   timeout=timeout)


def _flat(mesh: DeviceMesh, tokens: list[str], name: str) -> ProcessGroup:
    dims = [n for n in mesh.mesh_dim_names if n in tokens]  # in mesh order
    return mesh[tuple(dims)].flatten(name).get_group()


def _pp_lines(order: list[str], sizes: dict[str, int]) -> list[list[int]]:
    """Every pipeline group's ranks in a layout (computed locally, no groups made)."""
    axes = _axes(order, "")
    full = np.arange(math.prod(sizes[t] for t in axes)).reshape([sizes[t] for t in axes])
    d = axes.index("pp")
    return sorted(np.moveaxis(full, d, -1).reshape(-1, full.shape[d]).tolist())


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              context_parallel_size: int = 1,
                              expert_model_parallel_size: int = 1,
                              order: str = "tp-cp-ep-dp-pp", *,
                              expert_tensor_parallel_size: int | None = None,
                              distributed_timeout_minutes: float | None = None) -> None:
    """Build the tensor-, pipeline-, data-, context-, model- and expert-parallel groups.

    Every rank must call it with the same arguments.  The data-parallel size is the
    world size divided by tp x pp x cp.  Expert layers use their own layout (Megatron's
    expert ``RankGenerator``): tp -> expert_tensor_parallel_size (tp by default), ep,
    expert data parallel = world / (etp x ep x pp), no cp; its pipeline groups must be
    the decoder's.

    Args:
        order: the axes fastest-varying first (Megatron's default ``"tp-cp-ep-dp-pp"``).
        distributed_timeout_minutes: timeout of the new groups (WORLD's if None).

    Raises:
        RuntimeError: spmd is not initialised, or the groups already exist.
        ValueError: a size does not divide the world size, or a bad ``order``.
    """
    global _layout
    op = "initialize_model_parallel"
    world = _world_state.world
    if world is None:
        raise RuntimeError(f"{op}: spmd is not initialized; call spmd.init_process_group() first")
    if model_parallel_is_initialized():
        raise RuntimeError(f"{op}: model parallel groups are already initialized; call "
                           "destroy_model_parallel() first")
    tp = _positive(tensor_model_parallel_size, "tensor_model_parallel_size", op)
    pp = _positive(pipeline_model_parallel_size, "pipeline_model_parallel_size", op)
    cp = _positive(context_parallel_size, "context_parallel_size", op)
    ep = _positive(expert_model_parallel_size, "expert_model_parallel_size", op)
    etp = tp if expert_tensor_parallel_size is None else _positive(
        expert_tensor_parallel_size, "expert_tensor_parallel_size", op)
    n = world._size
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
    full_order = _full_order(order, decoder_sizes, op)
    _full_order(order, expert_sizes, op)
    if not (full_order[-1] == "pp" or pp == 1 or edp == dp):
        raise ValueError(f"{op}: with order {order!r} (pp not last), the expert data-parallel "
                         f"size ({edp}) must equal the data-parallel size ({dp})")
    timeout = None
    if distributed_timeout_minutes is not None:
        timeout = timedelta(minutes=float(distributed_timeout_minutes))

    decoder_pp, expert_pp = _pp_lines(full_order, decoder_sizes), _pp_lines(full_order, expert_sizes)
    if decoder_pp != expert_pp:
        raise ValueError(f"{op}: the pipeline groups of the expert layout {expert_pp} differ "
                         f"from the decoder's {decoder_pp}; use an order that ends with 'pp'")
    # Every check is done: from here on every rank splits.
    decoder = _layout_mesh(full_order, decoder_sizes, "ep", {}, timeout)
    expert_names = {"tp": "etp", "dp": "edp"}
    groups = {
        "tp": decoder.get_group("tp"),
        "pp": decoder.get_group("pp"),
        "dp": decoder.get_group("dp"),
        "cp": decoder.get_group("cp"),
        "dp-cp": _flat(decoder, ["dp", "cp"], "dp_cp"),
        "tp-pp": _flat(decoder, ["tp", "pp"], "mp"),
        "tp-cp": _flat(decoder, ["tp", "cp"], "tp_cp"),
        "tp-dp": _flat(decoder, ["tp", "dp"], "tp_dp"),
        "tp-dp-cp": _flat(decoder, ["tp", "dp", "cp"], "tp_dp_cp"),
    }
    expert = _layout_mesh(full_order, expert_sizes, "cp", expert_names, timeout,
                          given={"pp": groups["pp"]})
    groups.update({
        "ep": expert.get_group("ep"),
        "etp": expert.get_group("etp"),
        "edp": expert.get_group("edp"),
        "etp-ep": _flat(expert, ["etp", "ep"], "etp_ep"),
        "etp-ep-pp": _flat(expert, ["etp", "ep", "pp"], "etp_ep_pp"),
    })
    _layout = _Layout(world, decoder, expert, groups)


def model_parallel_is_initialized() -> bool:
    """True between initialize_model_parallel() and destroy_model_parallel()."""
    global _layout
    if _layout is not None and _layout.world is not _world_state.world:
        _layout = None  # spmd was destroyed (and maybe re-initialised) since
    return _layout is not None


def destroy_model_parallel() -> None:
    """Free the groups initialize_model_parallel made.  Every rank must call it."""
    global _layout
    if not model_parallel_is_initialized():
        _layout = None
        return
    from .world import destroy_process_group

    seen: set[int] = set()
    for pg in _layout.groups.values():
        if pg is _layout.world or pg is GroupMember.NON_GROUP_MEMBER or id(pg) in seen:
            continue
        seen.add(id(pg))
        if pg._comm is not None:
            destroy_process_group(pg)
    _layout = None


def _group(token: str, op: str, check_initialized: bool = True):
    if not model_parallel_is_initialized():
        if not check_initialized:
            return None
        raise RuntimeError(f"{op}: model parallel groups are not initialized; call "
                           "spmd.parallel_state.initialize_model_parallel() first")
    return _layout.groups[token]


# -- tensor parallel ---------------------------------------------------------------

def get_tensor_model_parallel_group(check_initialized: bool = True) -> ProcessGroup:
    """The tensor-parallel group holding this rank."""
    return _group("tp", "get_tensor_model_parallel_group", check_initialized)


def get_tensor_model_parallel_world_size() -> int:
    return _group("tp", "get_tensor_model_parallel_world_size").size()


def get_tensor_model_parallel_rank() -> int:
    return _group("tp", "get_tensor_model_parallel_rank").rank()


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in this rank's group."""
    return _group("tp", "get_tensor_model_parallel_src_rank").ranks[0]


# -- pipeline parallel -------------------------------------------------------------

def get_pipeline_model_parallel_group(check_initialized: bool = True) -> ProcessGroup:
    """The pipeline group holding this rank (stages in group-rank order)."""
    return _group("pp", "get_pipeline_model_parallel_group", check_initialized)


def get_pipeline_model_parallel_world_size() -> int:
    return _group("pp", "get_pipeline_model_parallel_world_size").size()


def get_pipeline_model_parallel_rank() -> int:
    return _group("pp", "get_pipeline_model_parallel_rank").rank()


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of the first stage of this rank's pipeline."""
    return _group("pp", "get_pipeline_model_parallel_first_rank").ranks[0]


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last stage of this rank's pipeline."""
    return _group("pp", "get_pipeline_model_parallel_last_rank").ranks[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (the first stage after the last)."""
    pg = _group("pp", "get_pipeline_model_parallel_next_rank")
    return pg.ranks[(pg.rank() + 1) % pg.size()]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage (the last stage before the first)."""
    pg = _group("pp", "get_pipeline_model_parallel_prev_rank")
    return pg.ranks[(pg.rank() - 1) % pg.size()]


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage=None) -> bool:
    """True on the first pipeline stage (there is no virtual pipeline here)."""
    return _group("pp", "is_pipeline_first_stage").rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage=None) -> bool:
    """True on the last pipeline stage (there is no virtual pipeline here)."""
    pg = _group("pp", "is_pipeline_last_stage")
    return pg.rank() == pg.size() - 1


# -- data and context parallel -----------------------------------------------------

def _dp(with_context_parallel: bool) -> str:
    return "dp-cp" if with_context_parallel else "dp"


def get_data_parallel_group(with_context_parallel: bool = False) -> ProcessGroup:
    """The data-parallel group (with the context-parallel ranks folded in if asked)."""
    return _group(_dp(with_context_parallel), "get_data_parallel_group")


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return _group(_dp(with_context_parallel), "get_data_parallel_world_size").size()


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _group(_dp(with_context_parallel), "get_data_parallel_rank").rank()


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of data-parallel rank 0 in this rank's group."""
    return _group(_dp(with_context_parallel), "get_data_parallel_src_rank").ranks[0]


def get_context_parallel_group(check_initialized: bool = True) -> ProcessGroup:
    """The context-parallel group holding this rank."""
    return _group("cp", "get_context_parallel_group", check_initialized)


def get_context_parallel_world_size() -> int:
    return _group("cp", "get_context_parallel_world_size").size()


def get_context_parallel_rank() -> int:
    return _group("cp", "get_context_parallel_rank").rank()


def get_context_parallel_global_ranks(check_initialized: bool = True) -> list[int] | None:
    """Global ranks of this rank's context-parallel group."""
    pg = _group("cp", "get_context_parallel_global_ranks", check_initialized)
    return None if pg is None else pg.ranks


# -- combined groups ---------------------------------------------------------------

def get_model_parallel_group(check_initialized: bool = True) -> ProcessGroup:
    """The model-parallel group: tensor and pipeline parallel ranks of one model copy."""
    return _group("tp-pp", "get_model_parallel_group", check_initialized)


def get_model_parallel_world_size() -> int:
    return _group("tp-pp", "get_model_parallel_world_size").size()


def get_model_parallel_rank() -> int:
    return _group("tp-pp", "get_model_parallel_rank").rank()


def get_model_parallel_src_rank() -> int:
    return _group("tp-pp", "get_model_parallel_src_rank").ranks[0]


def _tdp(with_context_parallel: bool) -> str:
    return "tp-dp-cp" if with_context_parallel else "tp-dp"


def get_tensor_and_data_parallel_group(check_initialized: bool = True,
                                       with_context_parallel: bool = False) -> ProcessGroup:
    """The tensor- and data-parallel ranks (and context-parallel ones if asked)."""
    return _group(_tdp(with_context_parallel), "get_tensor_and_data_parallel_group",
                  check_initialized)


def get_tensor_and_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return _group(_tdp(with_context_parallel), "get_tensor_and_data_parallel_world_size").size()


def get_tensor_and_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _group(_tdp(with_context_parallel), "get_tensor_and_data_parallel_rank").rank()


def get_tensor_and_context_parallel_group(check_initialized: bool = True) -> ProcessGroup:
    """The tensor- and context-parallel ranks together."""
    return _group("tp-cp", "get_tensor_and_context_parallel_group", check_initialized)


def get_tensor_and_context_parallel_world_size() -> int:
    return _group("tp-cp", "get_tensor_and_context_parallel_world_size").size()


def get_tensor_and_context_parallel_rank() -> int:
    return _group("tp-cp", "get_tensor_and_context_parallel_rank").rank()


# -- expert parallel ---------------------------------------------------------------

def get_expert_model_parallel_group(check_initialized: bool = True) -> ProcessGroup:
    """The expert-parallel group: ranks holding different experts of one layer."""
    return _group("ep", "get_expert_model_parallel_group", check_initialized)


def get_expert_model_parallel_world_size() -> int:
    return _group("ep", "get_expert_model_parallel_world_size").size()


def get_expert_model_parallel_rank() -> int:
    return _group("ep", "get_expert_model_parallel_rank").rank()


def get_expert_tensor_parallel_group(check_initialized: bool = True) -> ProcessGroup:
    """The tensor-parallel group of the expert layers."""
    return _group("etp", "get_expert_tensor_parallel_group", check_initialized)


def get_expert_tensor_parallel_world_size() -> int:
    return _group("etp", "get_expert_tensor_parallel_world_size").size()


def get_expert_tensor_parallel_rank() -> int:
    return _group("etp", "get_expert_tensor_parallel_rank").rank()


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True) -> ProcessGroup:
    """Expert tensor- and expert-parallel ranks together."""
    return _group("etp-ep", "get_expert_tensor_and_model_parallel_group", check_initialized)


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return _group("etp-ep", "get_expert_tensor_and_model_parallel_world_size").size()


def get_expert_tensor_and_model_parallel_rank() -> int:
    return _group("etp-ep", "get_expert_tensor_and_model_parallel_rank").rank()


def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool = True
                                                    ) -> ProcessGroup:
    """Expert tensor-, expert- and pipeline-parallel ranks together."""
    return _group("etp-ep-pp", "get_expert_tensor_model_pipeline_parallel_group",
                  check_initialized)


def get_expert_data_parallel_group(check_initialized: bool = True) -> ProcessGroup:
    """The data-parallel group of the expert layers."""
    return _group("edp", "get_expert_data_parallel_group", check_initialized)


def get_expert_data_parallel_world_size() -> int:
    return _group("edp", "get_expert_data_parallel_world_size").size()


def get_expert_data_parallel_rank() -> int:
    return _group("edp", "get_expert_data_parallel_rank").rank()
