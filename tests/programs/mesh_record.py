"""What a DeviceMesh says on each rank, recorded as JSON lines, for spmd and for torch.

    mpiexec -n 8 python tests/programs/mesh_record.py spmd     one line per rank
    python tests/programs/mesh_record.py torch 8              torch's fake backend, every
                                                              rank in turn in this process

For every shape: coordinate, local ranks, each dimension's group ranks, every submesh's
mesh array and every flattened submesh's group ranks.  tests/test_mesh.py compares the
two outputs line by line.
"""

import itertools
import json
import sys

SHAPES = {8: [(8,), (2, 4), (4, 2), (1, 8), (2, 2, 2), (2, 1, 4), (4, 1, 2)]}


def record(init_device_mesh, group_ranks, n):
    out = {}
    for shape in SHAPES[n]:
        names = ("a", "b", "c")[:len(shape)]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        rec = {"coordinate": list(mesh.get_coordinate()),
               "local_ranks": [mesh.get_local_rank(d) for d in range(len(shape))],
               "groups": [group_ranks(mesh.get_group(d)) for d in range(len(shape))],
               "mesh": mesh.mesh.tolist(), "shape": list(mesh.shape)}
        for k in range(2, len(shape) + 1):
            for pick in itertools.combinations(names, k):
                key = "".join(pick)
                sub = mesh[pick]
                rec[f"sub_{key}"] = sub.mesh.tolist()
                rec[f"flat_{key}"] = group_ranks(sub._flatten().get_group())
        out[str(shape)] = rec
    return out


def main():
    impl = sys.argv[1]
    if impl == "spmd":
        import spmd

        spmd.init_process_group()
        rec = record(spmd.init_device_mesh, spmd.get_process_group_ranks, spmd.get_world_size())
        sys.stdout.write(json.dumps({"rank": spmd.get_rank(), "record": rec}) + "\n")
        sys.stdout.flush()
        spmd.destroy_process_group()
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    n = int(sys.argv[2])
    for rank in range(n):
        dist.init_process_group("fake", rank=rank, world_size=n, store=FakeStore())
        rec = record(init_device_mesh, dist.get_process_group_ranks, n)
        sys.stdout.write(json.dumps({"rank": rank, "record": rec}) + "\n")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
