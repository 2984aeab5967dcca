"""Reference rank lists, computed independently of spmd's mesh code.

* ``megatron_groups`` re-implements Megatron-LM's ``RankGenerator`` /
  ``generate_masked_orthogonal_rank_groups`` (prefix-product strides, decompose
  the group index and the rank-in-group index), then the group kinds that
  ``initialize_model_parallel`` builds from its decoder and expert generators.
* ``mesh_groups`` enumerates torch DeviceMesh groups coordinate by coordinate.
* ``pseudo_node_groups`` lists pseudo-nodes of k consecutive ranks.

Imported by tests/test_*.py and by the programs in this directory.
"""

from __future__ import annotations

import itertools
import math

AXES = ("tp", "pp", "dp", "ep", "cp")


def _prefix_products(sizes):
    out, acc = [1], 1
    for s in sizes:
        acc *= s
        out.append(acc)
    return out


def _decompose(index, shape):
    """index = sum(idx[i] * stride[i]) with row-major strides fastest first."""
    idx = []
    for s in shape:
        idx.append(index % s)
        index //= s
    return idx


def masked_rank_groups(world_size, parallel_size, mask):
    """Megatron's generate_masked_orthogonal_rank_groups, written out again."""
    strides = _prefix_products(parallel_size)
    masked = [(s, d) for s, d, m in zip(parallel_size, strides, mask) if m]
    unmasked = [(s, d) for s, d, m in zip(parallel_size, strides, mask) if not m]
    group_size = math.prod(s for s, _ in masked)
    groups = []
    for g in range(world_size // group_size):
        g_idx = _decompose(g, [s for s, _ in unmasked])
        base = sum(i * d for i, (_, d) in zip(g_idx, unmasked))
        ranks = []
        for r in range(group_size):
            r_idx = _decompose(r, [s for s, _ in masked])
            ranks.append(base + sum(i * d for i, (_, d) in zip(r_idx, masked)))
        groups.append(ranks)
    return groups


class RankGenerator:
    """Megatron-LM's RankGenerator (no rank offset)."""

    def __init__(self, tp, ep, dp, pp, cp, order):
        assert ep == 1 or cp == 1
        self.sizes = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        self.world_size = tp * ep * dp * pp * cp
        tokens = order.lower().split("-")
        for name in ("tp", "pp", "dp", "ep", "cp"):
            if name not in tokens:
                assert self.sizes[name] == 1, f"{name} missing from order {order}"
                tokens.append(name)
        self.order = tokens

    def get_ranks(self, token):
        wanted = token.split("-")
        mask = [t in wanted for t in self.order]
        return masked_rank_groups(self.world_size, [self.sizes[t] for t in self.order], mask)


# spmd's keys for the group kinds (Megatron tokens; "e" prefix: expert generator)
DECODER_KINDS = ("tp", "pp", "dp", "cp", "dp-cp", "tp-pp", "tp-cp", "tp-dp", "tp-dp-cp")
EXPERT_KINDS = {"ep": "ep", "etp": "tp", "edp": "dp", "etp-ep": "tp-ep", "etp-ep-pp": "tp-ep-pp"}


def megatron_groups(world, tp=1, pp=1, cp=1, ep=1, etp=None, order="tp-cp-ep-dp-pp"):
    """{kind: list of rank lists} for every group kind initialize_model_parallel builds."""
    etp = tp if etp is None else etp
    dp = world // (tp * pp * cp)
    edp = world // (etp * ep * pp)
    dec = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    exp = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    out = {k: dec.get_ranks(k) for k in DECODER_KINDS}
    out.update({k: exp.get_ranks(t) for k, t in EXPERT_KINDS.items()})
    return out


def embedding_groups(pp_groups):
    """Megatron-LM's default embedding ranks per pipeline, as (word, position) lists:
    the word embeddings on the first and the last stage (one stage: just it), the
    position embeddings on the first stage."""
    word, position = [], []
    for stages in pp_groups:
        first, last = stages[0], stages[len(stages) - 1]
        word.append([first] if first == last else [first, last])
        position.append([first])
    return word, position


def pipeline_stage_flags(stage, stages, vp_size, vp_stage):
    """(is first, is last) for a rank at ``stage`` of ``stages`` asked with
    ignore_virtual=False: with a virtual pipeline only its first / last model chunk
    (``vp_stage``) counts."""
    first, last = stage == 0, stage == stages - 1
    if vp_size is not None:
        first, last = first and vp_stage == 0, last and vp_stage == vp_size - 1
    return first, last


def megatron_rejects(world, tp, pp, cp, ep, etp, order):
    """Why Megatron's initialize_model_parallel refuses these sizes, or None."""
    tokens = order.split("-")
    sizes = {"tp": tp, "pp": pp, "cp": cp, "ep": ep}
    if world % (tp * pp * cp):
        return "world not divisible by tp*pp*cp"
    if world % (etp * ep * pp):
        return "world not divisible by etp*ep*pp"
    missing = [t for t, s in sizes.items() if s > 1 and t not in tokens]
    if missing or (etp > 1 and "tp" not in tokens):
        return f"order lacks {missing}"
    dp, edp = world // (tp * pp * cp), world // (etp * ep * pp)
    full = tokens + [t for t in AXES if t not in tokens]
    if not (full[-1] == "pp" or pp == 1 or edp == dp):
        return "pp not last and expert dp != dp"
    if (RankGenerator(tp, 1, dp, pp, cp, order).get_ranks("pp")
            != RankGenerator(etp, ep, edp, pp, 1, order).get_ranks("pp")):
        return "expert pipeline groups differ"
    return None


def megatron_configs(world, orders=("tp-cp-ep-dp-pp", "tp-pp-dp", "tp-dp-pp"), rejected=False):
    """Every (tp, pp, cp, ep, etp, order) whose tp*pp*cp and etp*ep*pp divide the world
    that Megatron accepts (or, with ``rejected=True``, refuses for another reason)."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    out = []
    for order in orders:
        for tp, pp, cp, ep, etp in itertools.product(divisors, repeat=5):
            if world % (tp * pp * cp) or world % (etp * ep * pp):
                continue
            reason = megatron_rejects(world, tp, pp, cp, ep, etp, order)
            if (reason is not None) == rejected:
                out.append({"tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp, "order": order})
    return out


def mesh_groups(shape, dims):
    """torch DeviceMesh groups along ``dims`` (flattened) of a row-major ``shape``."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    others = [d for d in range(len(shape)) if d not in dims]
    groups = []
    for fixed in itertools.product(*(range(shape[d]) for d in others)):
        base = sum(c * strides[d] for c, d in zip(fixed, others))
        ranks = [base + sum(c * strides[d] for c, d in zip(cs, dims))
                 for cs in itertools.product(*(range(shape[d]) for d in dims))]
        groups.append(sorted(ranks))
    return groups


def shapes(world, max_dims=3):
    """Every ordered factorisation of ``world`` into 1..max_dims positive factors."""
    out = []
    for ndim in range(1, max_dims + 1):
        for dims in itertools.product(range(1, world + 1), repeat=ndim):
            if math.prod(dims) == world:
                out.append(dims)
    return out


def pseudo_node_groups(world, k):
    """(node groups, cross-node groups) for pseudo-nodes of k consecutive ranks."""
    nodes = [list(range(i, min(i + k, world))) for i in range(0, world, k)]
    cross = [[n[j] for n in nodes if j < len(n)] for j in range(min(k, world))]
    return nodes, cross


def group_of(groups, rank):
    """The one group of ``groups`` holding ``rank``."""
    hits = [g for g in groups if rank in g]
    assert len(hits) == 1, f"rank {rank} is in {len(hits)} groups of {groups}"
    return hits[0]
