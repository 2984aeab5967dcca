"""Megatron-style model-parallel groups: tensor, pipeline, data, context and expert.

``initialize_model_parallel`` lays the world out as Megatron-LM's ``RankGenerator``
does and builds every group on :class:`spmd.DeviceMesh`: the ``order`` string lists
the axes fastest-varying first, so the mesh shape is that list reversed (row-major).
Each kind of group costs one ``Comm.Split``, whatever the number of groups
(``spmd.layouts.megatron_groups`` builds them; this module keeps them and answers
Megatron's getters).  Group
ranks are the sorted global ranks, exactly Megatron's rank lists.

Virtual pipeline parallelism and the embedding / position-embedding groups follow
current Megatron-Core (``virtual_pipeline_model_parallel_size``, ``vp_stage``, the
first-and-last-stage default embedding ranks).

Differences from Megatron-LM: no Gloo, hierarchical, hybrid or distributed-optimizer
instance groups (docs/porting.md lists every Megatron getter spmd lacks); getters raise
RuntimeError (not AssertionError) before initialisation or where this rank has no such
group; a rank may be in one embedding group only; group timeouts default to WORLD's.
"""

from __future__ import annotations

import warnings

from spmd.layouts import megatron_groups
from spmd.layouts.megatron_groups import ModelParallelLayout, RanksFn
from spmd.runtime.group import ProcessGroup
from spmd.runtime.group import world_state as _world_state

__all__ = [
    "rebuild_model_parallel",
    "destroy_model_parallel",
    "get_context_parallel_global_ranks",
    "get_context_parallel_group",
    "get_context_parallel_rank",
    "get_context_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_src_rank",
    "get_data_parallel_world_size",
    "get_embedding_group",
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
    "get_position_embedding_group",
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
    "get_virtual_pipeline_model_parallel_rank",
    "get_virtual_pipeline_model_parallel_world_size",
    "initialize_model_parallel",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "is_rank_in_embedding_group",
    "is_rank_in_position_embedding_group",
    "model_parallel_is_initialized",
    "set_virtual_pipeline_model_parallel_rank",
    "set_virtual_pipeline_model_parallel_world_size",
]

_layout: ModelParallelLayout | None = None
_last_call: dict | None = None   # initialize_model_parallel's arguments, for a rebuild
# Megatron keeps these as plain globals that its setters may change at any time.
_vp_world_size: int | None = None
_vp_rank: int | None = None


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              context_parallel_size: int = 1,
                              expert_model_parallel_size: int = 1,
                              order: str = "tp-cp-ep-dp-pp", *,
                              expert_tensor_parallel_size: int | None = None,
                              virtual_pipeline_model_parallel_size: int | None = None,
                              get_embedding_ranks: RanksFn | None = None,
                              get_position_embedding_ranks: RanksFn | None = None,
                              distributed_timeout_minutes: float | None = None) -> None:
    """Build the tensor-, pipeline-, data-, context-, model- and expert-parallel groups.

    Every rank must call it with the same arguments.  The data-parallel size is the
    world size divided by tp x pp x cp.  Expert layers use their own layout (Megatron's
    expert ``RankGenerator``): tp -> expert_tensor_parallel_size (tp by default), ep,
    expert data parallel = world / (etp x ep x pp), no cp; its pipeline groups must be
    the decoder's.

    Each pipeline also gets an embedding group (``get_embedding_ranks(pipeline
    ranks)``; by default its first and last stage) and a position-embedding group (by
    default its first stage), one ``Comm.Split`` for each kind.

    Args:
        order: the axes fastest-varying first (Megatron's default ``"tp-cp-ep-dp-pp"``).
        virtual_pipeline_model_parallel_size: model chunks per pipeline stage
            (interleaved schedule); needs a pipeline of 2 stages or more.  Sets the
            virtual rank to 0.
        get_embedding_ranks: pipeline ranks -> the ranks holding word embeddings.
        get_position_embedding_ranks: pipeline ranks -> the ranks holding position
            embeddings.
        distributed_timeout_minutes: timeout of the new groups (WORLD's if None).

    Raises:
        RuntimeError: spmd is not initialised, the groups already exist, or a virtual
            pipeline without pipeline parallelism.
        ValueError: a size does not divide the world size, a bad ``order``, or embedding
            ranks outside the world or in two groups.
    """
    global _layout, _vp_world_size, _vp_rank, _last_call
    op = "initialize_model_parallel"
    world = _world_state.world
    if world is None:
        raise RuntimeError(f"{op}: spmd is not initialized; call spmd.init_process_group() first")
    if model_parallel_is_initialized():
        raise RuntimeError(f"{op}: model parallel groups are already initialized; call "
                           "destroy_model_parallel() first")
    _layout = megatron_groups.build(
        world, op, tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size, order=order,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
        distributed_timeout_minutes=distributed_timeout_minutes)
    _last_call = _layout.arguments
    vp = _layout.virtual_pipeline_size
    if vp is not None:  # as Megatron: without it, the globals are left as they are
        _vp_world_size, _vp_rank = vp, 0


def rebuild_model_parallel() -> None:
    """Build the groups again, with the arguments of the last
    :func:`initialize_model_parallel`, on the world as it is now: after
    ``spmd.shrink_group()`` of the default group (ranks died), the survivors call this and
    get the same tensor, pipeline, context and expert sizes with a smaller data-parallel
    size.  The old groups end first (the shrink ended them already).

    Raises:
        RuntimeError: initialize_model_parallel was never called.
        ValueError: the new world size is not divisible by tp x pp x cp (the message of
            initialize_model_parallel): fewer survivors than a model replica needs.
    """
    if _last_call is None:
        raise RuntimeError("rebuild_model_parallel: initialize_model_parallel() was never "
                           "called, so there is nothing to rebuild")
    destroy_model_parallel()
    initialize_model_parallel(**_last_call)


def model_parallel_is_initialized() -> bool:
    """True between initialize_model_parallel() and destroy_model_parallel()."""
    global _layout
    if _layout is not None and _layout.world is not _world_state.world:
        _layout = None  # spmd was destroyed (and maybe re-initialised) since
    return _layout is not None


def destroy_model_parallel() -> None:
    """Free the groups initialize_model_parallel made.  Every rank must call it."""
    global _layout, _vp_world_size, _vp_rank
    _vp_world_size = _vp_rank = None
    if not model_parallel_is_initialized():
        _layout = None
        return
    assert _layout is not None  # model_parallel_is_initialized() says so
    from spmd.runtime.world import destroy_process_group

    seen: set[int] = set()
    for pg in _layout.groups.values():
        # None where this rank has no such group (also skips a non-member sentinel)
        if not isinstance(pg, ProcessGroup) or pg is _layout.world or id(pg) in seen:
            continue
        seen.add(id(pg))
        if pg.context.comm is not None:
            destroy_process_group(pg)
    _layout = None


def _group(token: str, op: str, check_initialized: bool = True):
    if not model_parallel_is_initialized():
        if not check_initialized:
            return None
        raise RuntimeError(f"{op}: model parallel groups are not initialized; call "
                           "spmd.layouts.parallel_state.initialize_model_parallel() first")
    assert _layout is not None  # model_parallel_is_initialized() says so
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


def _vp_stage_is(want: int | None, ignore_virtual: bool, vp_stage, op: str) -> bool:
    """False if a virtual pipeline is on, asked about, and ``vp_stage`` is not ``want``."""
    if ignore_virtual or _vp_world_size is None:
        return True
    if vp_stage is None:
        raise ValueError(f"{op}: vp_stage must be passed if virtual pipeline is enabled "
                         f"(virtual_pipeline_model_parallel_size {_vp_world_size})")
    return vp_stage == want


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True on the first pipeline stage (and, unless ``ignore_virtual``, the first model
    chunk: ``vp_stage`` 0 when a virtual pipeline is on)."""
    op = "is_pipeline_first_stage"
    pg = _group("pp", op)
    return _vp_stage_is(0, ignore_virtual, vp_stage, op) and pg.rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True on the last pipeline stage (and, unless ``ignore_virtual``, the last model
    chunk: ``vp_stage`` = virtual world size - 1 when a virtual pipeline is on)."""
    op = "is_pipeline_last_stage"
    pg = _group("pp", op)
    last = None if _vp_world_size is None else _vp_world_size - 1
    return _vp_stage_is(last, ignore_virtual, vp_stage, op) and pg.rank() == pg.size() - 1


# -- virtual pipeline ----------------------------------------------------------------

def get_virtual_pipeline_model_parallel_rank() -> int | None:
    """The virtual pipeline rank (model chunk), or None without a virtual pipeline."""
    return _vp_rank


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Set the virtual pipeline rank (deprecated in Megatron: pass ``vp_stage``)."""
    global _vp_rank
    warnings.warn("set_virtual_pipeline_model_parallel_rank in global scope is deprecated. "
                  "Pass vp_stage explicitly to is_pipeline_first_stage, is_pipeline_last_stage, "
                  "etc.", DeprecationWarning, stacklevel=2)
    _vp_rank = rank


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """Model chunks per pipeline stage, or None without a virtual pipeline."""
    return _vp_world_size


def set_virtual_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Set the number of model chunks per pipeline stage (None: no virtual pipeline)."""
    global _vp_world_size
    _vp_world_size = world_size


# -- embedding -----------------------------------------------------------------------

def _embedding_group(token: str, what: str, op: str, check_initialized: bool):
    pg = _group(token, op, check_initialized)
    if pg is None and check_initialized:
        assert _layout is not None  # _group raised if it were not initialized
        pipeline = _layout.groups["pp"]
        assert pipeline is not None  # every rank is in a pipeline group
        raise RuntimeError(f"{op}: global rank {_layout.world.context.rank} is in no {what} group "
                           f"(its pipeline: {pipeline.ranks})")
    return pg


def get_embedding_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The word-embedding group holding this rank (its pipeline's first and last stage
    by default); None with ``check_initialized=False`` where there is none."""
    return _embedding_group("embd", "embedding", "get_embedding_group", check_initialized)


def get_position_embedding_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The position-embedding group holding this rank (its pipeline's first stage by
    default); None with ``check_initialized=False`` where there is none."""
    return _embedding_group("pos-embd", "position embedding", "get_position_embedding_group",
                            check_initialized)


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True if this rank holds word embeddings; unless ``ignore_virtual``, only for the
    model chunk that does (the first chunk on the first listed rank, the last chunk on
    the last listed rank)."""
    if not model_parallel_is_initialized():
        return False
    assert _layout is not None  # model_parallel_is_initialized() says so
    ranks, me = _layout.embedding["embd"], _layout.world.context.rank
    if ranks is None:
        return False
    if ignore_virtual or me not in (ranks[0], ranks[-1]):
        return True
    if me == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)


def is_rank_in_position_embedding_group() -> bool:
    """True if this rank holds position embeddings."""
    if not model_parallel_is_initialized():
        return False
    assert _layout is not None  # model_parallel_is_initialized() says so
    return _layout.embedding["pos-embd"] is not None


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
