"""Every group of every layout helper against independently computed rank lists.

Run as ``mpiexec -n N python tests/programs/layouts.py [--all | --ps-only K]`` (tests
use N = 8, 12 and 16) with ``SPMD_PSEUDO_NODE_SIZE=k`` set.  Checks, on every rank:

* init_device_mesh for every shape of N in 1-3 dimensions: each dimension's groups,
  coordinates, local ranks, every submesh of a 3-D mesh and every flattening;
* parallel_state for Megatron configurations (``--all``: every accepted one; else a
  selection covering every axis combination and order; ``--ps-only K``: every K-th of
  that selection and nothing else): all 14 group kinds, the embedding and
  position-embedding groups (Megatron's default rules), getters, virtual pipeline
  stages (every other configuration with pp > 1 has one); configurations Megatron
  refuses raise ValueError;
* node_topology and get_node_local_rank under pseudo-nodes.

For each group kind the groups of all ranks are gathered and must be exactly the
reference list; each group also sums the ranks with all_reduce.  Prints
``rank R/N layouts OK ...`` per rank; any failure aborts the job with exit code 1.
"""

import itertools
import os
import sys
import traceback

import layout_ref as ref
import numpy as np
from mpi4py import MPI

import spmd
from spmd.layouts import parallel_state as ps

KIND_GETTERS = {
    "tp": ps.get_tensor_model_parallel_group,
    "pp": ps.get_pipeline_model_parallel_group,
    "dp": lambda: ps.get_data_parallel_group(),
    "cp": ps.get_context_parallel_group,
    "dp-cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
    "tp-pp": ps.get_model_parallel_group,
    "tp-cp": ps.get_tensor_and_context_parallel_group,
    "tp-dp": lambda: ps.get_tensor_and_data_parallel_group(),
    "tp-dp-cp": lambda: ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
    "ep": ps.get_expert_model_parallel_group,
    "etp": ps.get_expert_tensor_parallel_group,
    "edp": ps.get_expert_data_parallel_group,
    "etp-ep": ps.get_expert_tensor_and_model_parallel_group,
    "etp-ep-pp": ps.get_expert_tensor_model_pipeline_parallel_group,
}


def check_kinds(groups: dict, expected: dict, what: str) -> int:
    """groups: {kind: this rank's ProcessGroup}; expected: {kind: every reference group}."""
    me, n = spmd.get_rank(), spmd.get_world_size()
    rows = [None] * n
    spmd.all_gather_object(rows, {k: g.ranks for k, g in groups.items()})
    sums = {k: np.array([me], np.int64) for k in groups}
    works = [spmd.all_reduce(sums[k], group=g, async_op=True) for k, g in groups.items()]
    for kind, want in expected.items():
        got = sorted(map(list, {tuple(row[kind]) for row in rows}))
        assert got == sorted(want), f"{what} {kind}: groups {got}, expected {sorted(want)}"
        mine = ref.group_of(want, me)
        assert groups[kind].ranks == mine and groups[kind].rank() == mine.index(me), \
            f"{what} {kind}: rank {me} got {groups[kind].ranks}, expected {mine}"
    for w in works:
        w.wait()
    for kind, g in groups.items():
        assert int(sums[kind][0]) == sum(g.ranks), f"{what} {kind}: all_reduce gave {sums[kind]}"
    return len(expected)


def free_mesh(mesh):
    for g in mesh._owned_groups():
        spmd.destroy_process_group(g)


def check_meshes() -> int:
    me, n = spmd.get_rank(), spmd.get_world_size()
    checks = 0
    for shape in ref.shapes(n):
        names = ("a", "b", "c")[:len(shape)]
        mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
        assert mesh.get_coordinate() == tuple(int(c) for c in np.unravel_index(me, shape))
        groups, expected = {}, {}
        for d, name in enumerate(names):
            groups[name], expected[name] = mesh.get_group(name), ref.mesh_groups(shape, (d,))
            assert mesh.get_local_rank(name) == mesh.get_coordinate()[d]
        for r in range(2, len(names) + 1):
            for pick in itertools.combinations(range(len(names)), r):
                sub = mesh[tuple(names[d] for d in pick)]
                full = np.arange(n).reshape(shape)
                index = tuple(slice(None) if d in pick else mesh.get_coordinate()[d]
                              for d in range(len(shape)))
                assert sub.mesh.tolist() == full[index].tolist(), (shape, pick)
                flat = sub._flatten()
                key = flat.mesh_dim_names[0]
                groups[key], expected[key] = flat.get_group(), ref.mesh_groups(shape, pick)
        checks += check_kinds(groups, expected, f"mesh {shape}")
        free_mesh(mesh)
    return checks


def init_ps(c, vp=None):
    ps.initialize_model_parallel(c["tp"], c["pp"], c["cp"], c["ep"], c["order"],
                                 expert_tensor_parallel_size=c["etp"],
                                 virtual_pipeline_model_parallel_size=vp)


def check_embedding_and_virtual(pp_groups, vp) -> int:
    """Embedding and position-embedding groups against Megatron's default rules, and
    the pipeline-stage questions with a virtual pipeline of ``vp`` chunks (or none)."""
    me, n = spmd.get_rank(), spmd.get_world_size()
    word, position = ref.embedding_groups(pp_groups)
    got = {"embd": ps.get_embedding_group(check_initialized=False),
           "pos-embd": ps.get_position_embedding_group(check_initialized=False)}
    rows = [None] * n
    spmd.all_gather_object(rows, {k: None if g is None else g.ranks for k, g in got.items()})
    for kind, want, getter in (("embd", word, ps.get_embedding_group),
                               ("pos-embd", position, ps.get_position_embedding_group)):
        lists = sorted({tuple(r[kind]) for r in rows if r[kind] is not None})
        assert lists == sorted(tuple(sorted(g)) for g in want), f"{kind}: {lists} vs {want}"
        mine = [g for g in want if me in g]
        if mine:
            assert got[kind].ranks == sorted(mine[0]) and getter() is got[kind]
            x = np.array([me], np.int64)
            spmd.all_reduce(x, group=got[kind])
            assert int(x[0]) == sum(mine[0]), f"{kind}: all_reduce gave {x}"
        else:
            assert got[kind] is None, f"{kind}: rank {me} got {got[kind]}"
            try:
                getter()
            except RuntimeError:
                pass
            else:
                raise AssertionError(f"{kind}: no error for rank {me}, in no such group")
    in_word = [g for g in word if me in g]
    assert ps.is_rank_in_embedding_group() == bool(in_word)
    assert ps.is_rank_in_position_embedding_group() == any(me in g for g in position)
    assert ps.get_virtual_pipeline_model_parallel_world_size() == vp
    assert ps.get_virtual_pipeline_model_parallel_rank() == (None if vp is None else 0)
    stages = ref.group_of(pp_groups, me)
    for chunk in range(vp or 1):
        first, last = ref.pipeline_stage_flags(stages.index(me), len(stages), vp, chunk)
        assert ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=chunk) == first
        assert ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=chunk) == last
        # the first listed rank holds the first chunk's embedding, the last the last's
        expect = bool(in_word) and (me not in (in_word[0][0], in_word[0][-1]) or
                                    (first if me == in_word[0][0] else last))
        assert ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=chunk) == expect
    return 2


def check_parallel_state(everything: bool, thin: int = 1) -> tuple[int, int]:
    me, n = spmd.get_rank(), spmd.get_world_size()
    configs = ref.megatron_configs(n)
    if not everything:  # every order, sizes with Megatron's default etp, a few others
        configs = [c for c in configs if c["etp"] == c["tp"] and (c["cp"] == 1 or c["ep"] == 1)]
        configs += [c for c in ref.megatron_configs(n, orders=("tp-cp-ep-dp-pp",))
                    if c["etp"] != c["tp"]][::7]
    configs = configs[::thin]
    checks = 0
    for i, c in enumerate(configs):
        vp = 2 + i % 3 if c["pp"] > 1 and i % 2 == 0 else None  # half with a virtual pipeline
        init_ps(c, vp)
        groups = {k: get() for k, get in KIND_GETTERS.items()}
        expected = ref.megatron_groups(n, c["tp"], c["pp"], c["cp"], c["ep"], c["etp"], c["order"])
        checks += check_kinds(groups, expected, f"parallel_state {c}")
        checks += check_embedding_and_virtual(expected["pp"], vp)
        pp = ref.group_of(expected["pp"], me)
        stage = pp.index(me)
        assert ps.get_pipeline_model_parallel_rank() == stage
        assert ps.get_pipeline_model_parallel_next_rank() == pp[(stage + 1) % len(pp)]
        assert ps.get_pipeline_model_parallel_prev_rank() == pp[(stage - 1) % len(pp)]
        assert ps.is_pipeline_first_stage() == (stage == 0)
        assert ps.is_pipeline_last_stage() == (stage == len(pp) - 1)
        assert ps.get_pipeline_model_parallel_first_rank() == pp[0]
        assert ps.get_pipeline_model_parallel_last_rank() == pp[-1]
        assert ps.get_data_parallel_world_size() == n // (c["tp"] * c["pp"] * c["cp"])
        assert ps.get_data_parallel_src_rank(with_context_parallel=True) == \
            ref.group_of(expected["dp-cp"], me)[0]
        assert ps.get_tensor_model_parallel_src_rank() == ref.group_of(expected["tp"], me)[0]
        ps.destroy_model_parallel()
    refused = ref.megatron_configs(n, rejected=True)[::5 if everything else 25]
    for c in refused:
        try:
            init_ps(c)
        except ValueError:
            continue
        raise AssertionError(f"initialize_model_parallel accepted {c}")
    return len(configs), checks


def check_topology() -> int:
    me, n = spmd.get_rank(), spmd.get_world_size()
    k0 = int(os.environ["SPMD_PSEUDO_NODE_SIZE"])
    assert spmd.get_node_local_rank() == me % k0, "get_node_local_rank ignores pseudo-nodes"
    checks = 0
    for k in sorted({k0, 1, 4, n}):
        os.environ["SPMD_PSEUDO_NODE_SIZE"] = str(k)
        topo = spmd.node_topology()
        nodes, cross = ref.pseudo_node_groups(n, k)
        assert (topo.local_rank, topo.local_size) == (me % k, len(ref.group_of(nodes, me)))
        assert (topo.node_rank, topo.num_nodes) == (me // k, len(nodes))
        checks += check_kinds({"node": topo.node_group, "cross": topo.cross_node_group},
                              {"node": nodes, "cross": cross}, f"topology k={k}")
        spmd.destroy_process_group(topo.node_group)
        spmd.destroy_process_group(topo.cross_node_group)
    os.environ["SPMD_PSEUDO_NODE_SIZE"] = str(k0)
    return checks


def main() -> None:
    spmd.init_process_group()
    me, n = spmd.get_rank(), spmd.get_world_size()
    ps_only = "--ps-only" in sys.argv
    mesh_checks = 0 if ps_only else check_meshes()
    thin = int(sys.argv[sys.argv.index("--ps-only") + 1]) if ps_only else 1
    configs, ps_checks = check_parallel_state("--all" in sys.argv, thin)
    topo_checks = 0 if ps_only else check_topology()
    spmd.barrier()
    # One write per line: the launcher merges the ranks' output line by line.
    sys.stdout.write(f"rank {me}/{n} layouts OK: {mesh_checks} mesh, {ps_checks} parallel_state "
                     f"({configs} configurations), {topo_checks} topology group kinds\n")
    sys.stdout.flush()
    spmd.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001 - a failed rank must not leave the others waiting
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
