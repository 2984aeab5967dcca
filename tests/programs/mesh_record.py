"""What a DeviceMesh says on each rank, recorded as JSON lines, for spmd and for torch.

    mpiexec -n 8 python tests/programs/mesh_record.py spmd     one line per rank
    python tests/programs/mesh_record.py torch 8              torch's fake backend, every
                                                              rank in turn in this process

For every shape: coordinate, local ranks, each dimension's group ranks, every submesh's
mesh array and every flattened submesh's group ranks; then meshes made by ``_unflatten``
(of root, flattened and unflattened dimensions), ``_flatten`` of those, and
``_concatenate`` of submeshes in every order: their mesh, coordinate, groups, whether
their root is the original mesh, and which calls are refused.  Group identity is
recorded too: every group gets a number in the order it is first seen, so two meshes
sharing a group (or not) show the same numbers in both outputs.  tests/mpi/test_mesh.py
compares the two outputs line by line.
"""

import itertools
import json
import sys

SHAPES = {8: [(8,), (2, 4), (4, 2), (1, 8), (2, 2, 2), (2, 1, 4), (4, 1, 2)]}


def _splits(size):
    return [(a, size // a) for a in range(1, size + 1) if size % a == 0]


class Ids:
    """Numbers groups in the order first seen (``key`` says which groups are the same)."""

    def __init__(self, key):
        self.key, self.seen, self.keep = key, {}, []

    def __call__(self, pg):
        self.keep.append(pg)  # keep groups alive so that ids are never reused
        return self.seen.setdefault(self.key(pg), len(self.seen))


def describe(mesh, root, group_ranks, ids):
    groups = mesh.get_all_groups()
    return {"mesh": mesh.mesh.tolist(), "shape": list(mesh.shape),
            "names": list(mesh.mesh_dim_names), "coordinate": list(mesh.get_coordinate()),
            "local_ranks": [mesh.get_local_rank(d) for d in range(mesh.ndim)],
            "groups": [group_ranks(g) for g in groups], "ids": [ids(g) for g in groups],
            "same_root": mesh._get_root_mesh() is root}


def refused(call, *args):
    try:
        call(*args)
    except Exception:  # noqa: BLE001 - the two libraries raise different types
        return True
    return False


def record(init_device_mesh, concatenate, group_ranks, ids, n):
    out = {}
    for shape in SHAPES[n]:
        names = ("a", "b", "c")[:len(shape)]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        rec = {"coordinate": list(mesh.get_coordinate()),
               "local_ranks": [mesh.get_local_rank(d) for d in range(len(shape))],
               "groups": [group_ranks(mesh.get_group(d)) for d in range(len(shape))],
               "ids": [ids(g) for g in mesh.get_all_groups()],
               "mesh": mesh.mesh.tolist(), "shape": list(mesh.shape)}
        for k in range(2, len(shape) + 1):
            for pick in itertools.combinations(names, k):
                key = "".join(pick)
                sub = mesh[pick]
                rec[f"sub_{key}"] = sub.mesh.tolist()
                flat = sub._flatten()
                rec[f"flat_{key}"] = group_ranks(flat.get_group())
                rec[f"flat_id_{key}"] = ids(flat.get_group())
                rec[f"flat_again_{key}"] = ids(sub._flatten().get_group())
        count = itertools.count()
        # unflatten every dimension of the root and of the whole mesh flattened
        whole = mesh._flatten("all") if len(shape) > 1 else mesh
        for src, dim in [(mesh, d) for d in names] + [(whole, whole.mesh_dim_names[0])]:
            for sizes in _splits(src.size(src.mesh_dim_names.index(dim))):
                k = next(count)
                u = src._unflatten(dim, sizes, ("p", "q"))
                rec[f"unflat_{k}"] = describe(u, mesh, group_ranks, ids)
                rec[f"unflat_flat_{k}"] = ids(u["p", "q"]._flatten(f"pq{k}").get_group())
                if sizes[1] % 2 == 0:  # unflatten an unflattened dimension again
                    uu = u._unflatten("q", (2, sizes[1] // 2), ("q0", "q1"))
                    rec[f"unflat2_{k}"] = describe(uu, mesh, group_ranks, ids)
        rec["refused"] = [
            refused(mesh._unflatten, 0, (shape[0] + 1, 1), ("p", "q")),
            refused(mesh._unflatten, "zz", (shape[0],), ("p",)),
            refused(mesh._unflatten, len(shape), (1,), ("p",)),
            refused(mesh._unflatten, 0, (shape[0], 1), ("p",)),
            # overlapping (spmd also refuses repeated names, which torch lets through)
            refused(concatenate, [mesh, mesh[names[shape.index(max(shape))]]]),
        ]
        # concatenate 1-D submeshes (and flattened ones) in every order
        parts = [mesh[d] for d in names] + ([mesh[names[:2]]._flatten()] if len(shape) == 3 else [])
        for r in range(1, len(parts) + 1):
            for combo in itertools.permutations(range(len(parts)), r):
                chosen = [parts[i] for i in combo]
                key = "".join(map(str, combo))
                if refused(concatenate, chosen):
                    rec[f"cat_{key}"] = "refused"
                    continue
                rec[f"cat_{key}"] = describe(concatenate(chosen), mesh, group_ranks, ids)
        out[str(shape)] = rec
    return out


def main():
    impl = sys.argv[1]
    if impl == "spmd":
        import spmd

        spmd.init_process_group()
        rec = record(spmd.init_device_mesh, spmd.DeviceMesh._concatenate,
                     spmd.get_process_group_ranks, Ids(id), spmd.get_world_size())
        sys.stdout.write(json.dumps({"rank": spmd.get_rank(), "record": rec}) + "\n")
        sys.stdout.flush()
        spmd.destroy_process_group()
        return
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    warnings.simplefilter("ignore")  # torch warns about slicing flattened dimensions
    n = int(sys.argv[2])
    for rank in range(n):
        dist.init_process_group("fake", rank=rank, world_size=n, store=FakeStore())
        rec = record(init_device_mesh, DeviceMesh._concatenate, dist.get_process_group_ranks,
                     Ids(lambda pg: pg.group_name), n)
        sys.stdout.write(json.dumps({"rank": rank, "record": rec}) + "\n")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
