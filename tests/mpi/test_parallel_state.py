"""parallel_state: every group kind against an independent re-implementation of
Megatron-LM's RankGenerator, embedding groups and virtual pipeline stages, getters,
errors; at 8, 12 and 16 ranks a separate job checks every group of every layout helper
(tests/programs/layouts.py)."""


import layout_ref as ref
import numpy as np
import pytest
from conftest import TEST_TIMEOUT

KINDS = {
    "tp": ("get_tensor_model_parallel_group", {}),
    "pp": ("get_pipeline_model_parallel_group", {}),
    "dp": ("get_data_parallel_group", {}),
    "cp": ("get_context_parallel_group", {}),
    "dp-cp": ("get_data_parallel_group", {"with_context_parallel": True}),
    "tp-pp": ("get_model_parallel_group", {}),
    "tp-cp": ("get_tensor_and_context_parallel_group", {}),
    "tp-dp": ("get_tensor_and_data_parallel_group", {}),
    "tp-dp-cp": ("get_tensor_and_data_parallel_group", {"with_context_parallel": True}),
    "ep": ("get_expert_model_parallel_group", {}),
    "etp": ("get_expert_tensor_parallel_group", {}),
    "edp": ("get_expert_data_parallel_group", {}),
    "etp-ep": ("get_expert_tensor_and_model_parallel_group", {}),
    "etp-ep-pp": ("get_expert_tensor_model_pipeline_parallel_group", {}),
}
# kind -> (world size getter, rank getter, kwargs), where parallel_state has them
SIZE_RANK = {
    "tp": ("get_tensor_model_parallel_world_size", "get_tensor_model_parallel_rank", {}),
    "pp": ("get_pipeline_model_parallel_world_size", "get_pipeline_model_parallel_rank", {}),
    "dp": ("get_data_parallel_world_size", "get_data_parallel_rank", {}),
    "dp-cp": ("get_data_parallel_world_size", "get_data_parallel_rank",
              {"with_context_parallel": True}),
    "cp": ("get_context_parallel_world_size", "get_context_parallel_rank", {}),
    "tp-pp": ("get_model_parallel_world_size", "get_model_parallel_rank", {}),
    "tp-cp": ("get_tensor_and_context_parallel_world_size",
              "get_tensor_and_context_parallel_rank", {}),
    "tp-dp": ("get_tensor_and_data_parallel_world_size", "get_tensor_and_data_parallel_rank", {}),
    "ep": ("get_expert_model_parallel_world_size", "get_expert_model_parallel_rank", {}),
    "etp": ("get_expert_tensor_parallel_world_size", "get_expert_tensor_parallel_rank", {}),
    "edp": ("get_expert_data_parallel_world_size", "get_expert_data_parallel_rank", {}),
    "etp-ep": ("get_expert_tensor_and_model_parallel_world_size",
               "get_expert_tensor_and_model_parallel_rank", {}),
}


def _init(ps, c):
    ps.initialize_model_parallel(c["tp"], c["pp"], c["cp"], c["ep"], c["order"],
                                 expert_tensor_parallel_size=c["etp"])


@pytest.mark.mpi
def test_every_configuration_matches_megatron(dist):
    ps = dist.parallel_state
    me, n = dist.get_rank(), dist.get_world_size()
    configs = ref.megatron_configs(n)
    assert configs
    for c in configs:
        _init(ps, c)
        assert ps.model_parallel_is_initialized()
        expected = ref.megatron_groups(n, c["tp"], c["pp"], c["cp"], c["ep"], c["etp"],
                                       c["order"])
        mine = {}
        for kind, (getter, kwargs) in KINDS.items():
            pg = getattr(ps, getter)(**kwargs)
            want = ref.group_of(expected[kind], me)
            assert pg.ranks == want, (c, kind)
            assert pg.rank() == want.index(me)
            mine[kind] = pg.ranks
        rows = [None] * n  # every rank's groups: together exactly Megatron's lists
        dist.all_gather_object(rows, mine)
        for kind in KINDS:
            assert sorted({tuple(r[kind]) for r in rows}) == \
                sorted(map(tuple, expected[kind])), (c, kind)
        for kind, (size, rank, kwargs) in SIZE_RANK.items():
            want = ref.group_of(expected[kind], me)
            assert getattr(ps, size)(**kwargs) == len(want), (c, kind)
            assert getattr(ps, rank)(**kwargs) == want.index(me), (c, kind)
        ps.destroy_model_parallel()
        assert not ps.model_parallel_is_initialized()


@pytest.mark.mpi
def test_pipeline_neighbours_and_sources(dist):
    ps = dist.parallel_state
    me, n = dist.get_rank(), dist.get_world_size()
    for pp in [d for d in range(1, n + 1) if n % d == 0]:
        ps.initialize_model_parallel(pipeline_model_parallel_size=pp)
        stages = ref.group_of(ref.megatron_groups(n, pp=pp)["pp"], me)
        s = stages.index(me)
        assert ps.is_pipeline_first_stage() == (s == 0)
        assert ps.is_pipeline_last_stage() == (s == pp - 1)
        assert ps.get_pipeline_model_parallel_next_rank() == stages[(s + 1) % pp]
        assert ps.get_pipeline_model_parallel_prev_rank() == stages[(s - 1) % pp]
        assert ps.get_pipeline_model_parallel_first_rank() == stages[0]
        assert ps.get_pipeline_model_parallel_last_rank() == stages[-1]
        assert ps.get_data_parallel_src_rank() == ps.get_data_parallel_group().ranks[0]
        assert ps.get_model_parallel_src_rank() == ps.get_model_parallel_group().ranks[0]
        assert ps.get_tensor_model_parallel_src_rank() == me  # tp = 1
        assert ps.get_context_parallel_global_ranks() == [me]
        if pp > 1:  # a message around the pipeline ring reaches the next stage
            x = np.array([float(me)])
            got = np.zeros(1)
            works = [dist.isend(x, dst=ps.get_pipeline_model_parallel_next_rank()),
                     dist.irecv(got, src=ps.get_pipeline_model_parallel_prev_rank())]
            for w in works:
                w.wait()
            assert got[0] == ps.get_pipeline_model_parallel_prev_rank()
        ps.destroy_model_parallel()


@pytest.mark.mpi
def test_refused_sizes(dist):
    ps = dist.parallel_state
    n = dist.get_world_size()
    with pytest.raises(ValueError, match=rf"world size {n} is not divisible by "
                                         rf"tensor_model_parallel_size \({n + 1}\)"):
        ps.initialize_model_parallel(tensor_model_parallel_size=n + 1)
    with pytest.raises(ValueError, match=rf"world size {n} is not divisible by "
                                         rf"expert_tensor_parallel_size \(1\) x "
                                         rf"expert_model_parallel_size \({2 * n}\)"):
        ps.initialize_model_parallel(expert_model_parallel_size=2 * n)
    with pytest.raises(ValueError, match="order 'tp-xp-dp' has unknown axis 'xp'"):
        ps.initialize_model_parallel(order="tp-xp-dp")
    with pytest.raises(ValueError, match="order 'tp-dp-tp' names an axis twice"):
        ps.initialize_model_parallel(order="tp-dp-tp")
    with pytest.raises(ValueError, match="tensor_model_parallel_size must be positive, got 0"):
        ps.initialize_model_parallel(tensor_model_parallel_size=0)
    with pytest.raises(TypeError, match="must be an int, got float"):
        ps.initialize_model_parallel(pipeline_model_parallel_size=1.0)
    refused = ref.megatron_configs(n, rejected=True)
    if not refused:
        pytest.skip(f"at world size {n} every divisible size combination is accepted")
    for c in refused:
        with pytest.raises(ValueError):
            _init(ps, c)
    assert not ps.model_parallel_is_initialized()


@pytest.mark.mpi
def test_state_errors_and_reinit(dist):
    ps = dist.parallel_state
    with pytest.raises(RuntimeError, match="get_tensor_model_parallel_group: model parallel "
                                           "groups are not initialized"):
        ps.get_tensor_model_parallel_group()
    assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    ps.initialize_model_parallel()
    with pytest.raises(RuntimeError, match="already initialized"):
        ps.initialize_model_parallel()
    ps.destroy_model_parallel()
    ps.destroy_model_parallel()  # a second call does nothing
    ps.initialize_model_parallel(distributed_timeout_minutes=0.5)
    tp = ps.get_tensor_model_parallel_group()
    assert tp.timeout.total_seconds() == 30
    dist.destroy_process_group()  # destroying spmd forgets the layout
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="not initialized"):
        ps.get_data_parallel_rank()
    dist.init_process_group(timeout=TEST_TIMEOUT)


@pytest.mark.mpi
def test_embedding_groups_and_virtual_pipeline(dist):
    ps = dist.parallel_state
    me, n = dist.get_rank(), dist.get_world_size()
    for pp in [d for d in range(1, n + 1) if n % d == 0]:
        vp = 3 if pp > 1 else None
        ps.initialize_model_parallel(pipeline_model_parallel_size=pp,
                                     virtual_pipeline_model_parallel_size=vp)
        stages = ref.group_of(ref.megatron_groups(n, pp=pp)["pp"], me)
        word, position = ref.embedding_groups(ref.megatron_groups(n, pp=pp)["pp"])
        in_word = [g for g in word if me in g]
        if in_word:
            assert ps.get_embedding_group().ranks == sorted(in_word[0])
        else:
            assert ps.get_embedding_group(check_initialized=False) is None
            with pytest.raises(RuntimeError, match="is in no embedding group"):
                ps.get_embedding_group()
        assert ps.is_rank_in_embedding_group() == bool(in_word)
        assert ps.is_rank_in_position_embedding_group() == any(me in g for g in position)
        assert any(me in g for g in position) == (me == stages[0])
        assert (ps.get_position_embedding_group(check_initialized=False) is not None) == \
            (me == stages[0])
        assert ps.get_virtual_pipeline_model_parallel_world_size() == vp
        assert ps.get_virtual_pipeline_model_parallel_rank() == (None if vp is None else 0)
        for chunk in range(vp or 1):
            first, last = ref.pipeline_stage_flags(stages.index(me), pp, vp, chunk)
            assert ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=chunk) == first
            assert ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=chunk) == last
            assert ps.is_pipeline_first_stage(vp_stage=chunk) == (me == stages[0])
        if vp is not None:
            with pytest.raises(ValueError, match="vp_stage must be passed"):
                ps.is_pipeline_first_stage(ignore_virtual=False)
            with pytest.warns(DeprecationWarning):
                ps.set_virtual_pipeline_model_parallel_rank(2)
            assert ps.get_virtual_pipeline_model_parallel_rank() == 2
        if in_word:  # the embedding group carries a real collective
            x = np.array([float(me)])
            dist.all_reduce(x, group=ps.get_embedding_group())
            assert x[0] == sum(in_word[0])
        ps.destroy_model_parallel()
        assert ps.get_virtual_pipeline_model_parallel_world_size() is None
    # a rule of one's own: every rank holds the embeddings of its own stage only
    ps.initialize_model_parallel(get_embedding_ranks=lambda ranks: ranks[-1:],
                                 get_position_embedding_ranks=lambda ranks: ranks)
    assert ps.get_embedding_group().ranks == [me] and ps.is_rank_in_position_embedding_group()
    ps.destroy_model_parallel()
    with pytest.raises(RuntimeError, match="needs pipeline_model_parallel_size > 1"):
        ps.initialize_model_parallel(virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match=rf"returned \[{n}\], expected global ranks"):
        ps.initialize_model_parallel(get_embedding_ranks=lambda ranks: [n])
    if n > 1:  # n pipelines (pp = 1) all naming rank 0; at one rank there is one pipeline
        with pytest.raises(ValueError, match="one embedding group only"):
            ps.initialize_model_parallel(get_embedding_ranks=lambda ranks: [0])
    assert not ps.model_parallel_is_initialized()


