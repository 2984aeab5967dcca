"""Every group of every layout helper against independently computed rank lists.

Run as ``mpiexec -n N python tests/programs/layouts.py [--all]`` (tests use N = 8 and
12) with ``SPMD_PSEUDO_NODE_SIZE=k`` set.  Checks, on every rank:

* init_device_mesh for every shape of N in 1-3 dimensions: each dimension's groups,
  coordinates, local ranks, every submesh of a 3-D mesh and every flattening;
* parallel_state for Megatron configurations (``--all``: every accepted one; else a
  selection covering every axis combination and order): all 14 group kinds, getters;
  configurations Megatron refuses raise ValueError;
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
from spmd import parallel_state as ps

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


def init_ps(c):
    ps.initialize_model_parallel(c["tp"], c["pp"], c["cp"], c["ep"], c["order"],
                                 expert_tensor_parallel_size=c["etp"])


def check_parallel_state(everything: bool) -> tuple[int, int]:
    me, n = spmd.get_rank(), spmd.get_world_size()
    configs = ref.megatron_configs(n)
    if not everything:  # every order, sizes with Megatron's default etp, a few others
        configs = [c for c in configs if c["etp"] == c["tp"] and (c["cp"] == 1 or c["ep"] == 1)]
        configs += [c for c in ref.megatron_configs(n, orders=("tp-cp-ep-dp-pp",))
                    if c["etp"] != c["tp"]][::7]
    checks = 0
    for c in configs:
        init_ps(c)
        groups = {k: get() for k, get in KIND_GETTERS.items()}
        expected = ref.megatron_groups(n, c["tp"], c["pp"], c["cp"], c["ep"], c["etp"], c["order"])
        checks += check_kinds(groups, expected, f"parallel_state {c}")
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
    mesh_checks = check_meshes()
    configs, ps_checks = check_parallel_state("--all" in sys.argv)
    topo_checks = check_topology()
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
