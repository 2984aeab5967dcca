"""DeviceMesh and init_device_mesh: groups against independently enumerated rank lists,
submeshes, flattening, unflattening, concatenating, from_group, one Comm.Split per
dimension, bad input; and, at 8 ranks, the same answers and group identity as torch's
own DeviceMesh (on its fake backend), rank by rank.

The 8- and 12-rank layouts run in test_parallel_state.py (tests/programs/layouts.py)."""


import layout_ref as ref
import numpy as np
import pytest

NAMES = ("a", "b", "c")


def _free(dist, *meshes):
    """Destroy the groups the meshes made (never WORLD), once each."""
    seen = set()
    for mesh in meshes:
        for g in mesh._owned_groups():
            if id(g) not in seen:
                seen.add(id(g))
                dist.destroy_process_group(g)


def _sum_of_ranks(dist, pg):
    x = np.array([dist.get_rank()], np.int64)
    dist.all_reduce(x, group=pg)
    return int(x[0])


def _all_groups(dist, pg):
    """Every rank's group of one kind, as a sorted list of distinct rank lists."""
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, pg.ranks)
    return sorted(map(list, {tuple(r) for r in rows}))


@pytest.mark.mpi
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_every_shape_matches_reference(dist, ndim):
    me, n = dist.get_rank(), dist.get_world_size()
    for shape in [s for s in ref.shapes(n) if len(s) == ndim]:
        names = NAMES[:ndim]
        mesh = dist.init_device_mesh("cpu", shape, mesh_dim_names=names)
        assert mesh.shape == shape and mesh.ndim == ndim and mesh.size() == n
        assert mesh.mesh_dim_names == names and mesh.device_type == "cpu"
        assert mesh.mesh.tolist() == np.arange(n).reshape(shape).tolist()
        assert mesh.get_coordinate() == tuple(int(c) for c in np.unravel_index(me, shape))
        assert mesh.get_rank() == me
        for d, name in enumerate(names):
            expected = ref.group_of(ref.mesh_groups(shape, (d,)), me)
            for key in (d, name):
                pg = mesh.get_group(key)
                assert pg.ranks == expected, (shape, name)
                assert mesh.get_local_rank(key) == mesh.get_coordinate()[d] == pg.rank()
            assert mesh.size(d) == shape[d]
            assert _all_groups(dist, mesh.get_group(d)) == sorted(ref.mesh_groups(shape, (d,)))
            assert _sum_of_ranks(dist, mesh.get_group(d)) == sum(expected)
        assert mesh.get_all_groups() == [mesh.get_group(d) for d in range(ndim)]
        if ndim == 1:
            assert mesh.get_group() is mesh.get_group(0)
            assert mesh.get_group() is dist.GroupMember.WORLD  # as torch: the default group
        _free(dist, mesh)


@pytest.mark.mpi
def test_submeshes(dist):
    n = dist.get_world_size()
    shape = (2, 1, n // 2) if n % 2 == 0 else (1, n, 1)
    mesh = dist.init_device_mesh("cpu", shape, mesh_dim_names=NAMES)
    full = np.arange(n).reshape(shape)
    coord = mesh.get_coordinate()
    for pick in [("a",), ("b",), ("c",), ("a", "b"), ("a", "c"), ("b", "c")]:
        dims = [NAMES.index(p) for p in pick]
        sub = mesh[pick if len(pick) > 1 else pick[0]]
        assert sub.mesh_dim_names == pick and sub.shape == tuple(shape[d] for d in dims)
        index = tuple(slice(None) if d in dims else coord[d] for d in range(3))
        assert sub.mesh.tolist() == full[index].tolist()
        assert sub.get_coordinate() == tuple(coord[d] for d in dims)
        for name in pick:  # a submesh shares its parent's groups
            assert sub.get_group(name) is mesh.get_group(name)
    assert mesh[NAMES] is mesh
    assert mesh["a", "c"]["c"].get_group() is mesh.get_group("c")
    _free(dist, mesh)


@pytest.mark.mpi
def test_flatten(dist):
    me, n = dist.get_rank(), dist.get_world_size()
    shape = (2, 1, n // 2) if n % 2 == 0 else (1, n, 1)
    mesh = dist.init_device_mesh("cpu", shape, mesh_dim_names=("dp", "cp", "tp"))
    for pick, dims in [(("dp", "cp"), (0, 1)), (("cp", "tp"), (1, 2)), (("dp", "tp"), (0, 2)),
                       (("dp", "cp", "tp"), (0, 1, 2))]:
        flat = mesh[pick]._flatten()
        name = "_".join(pick)
        assert flat.mesh_dim_names == (name,) and flat.ndim == 1
        expected = ref.group_of(ref.mesh_groups(shape, dims), me)
        assert flat.get_group().ranks == expected == sorted(flat.mesh.tolist())
        assert mesh.get_group(name) is flat.get_group()      # the root knows it
        assert mesh[name].get_group() is flat.get_group()    # and slices it
        assert mesh[pick].flatten() is flat                  # made once
        assert _sum_of_ranks(dist, flat.get_group()) == sum(expected)
    assert mesh["dp_cp", "tp"].shape == (shape[0] * shape[1], shape[2])
    custom = mesh["dp", "cp"]._flatten("replicate")
    assert custom.get_group().ranks == mesh.get_group("dp_cp").ranks
    with pytest.raises(ValueError, match="already a dimension"):
        mesh["dp", "cp"]._flatten("tp")
    if ref.mesh_groups(shape, (0, 1)) != ref.mesh_groups(shape, (1, 2)):
        with pytest.raises(ValueError, match="already named 'replicate'"):
            mesh["cp", "tp"]._flatten("replicate")
    else:  # the same ranks laid out alike (torch compares layouts): the same mesh
        assert mesh["cp", "tp"]._flatten("replicate") is custom
    tp = mesh["tp"]
    assert tp._flatten("tp") is tp  # a 1-D mesh flattened into its own name is itself
    _free(dist, mesh)


@pytest.mark.mpi
def test_unflatten_and_concatenate(dist):
    me, n = dist.get_rank(), dist.get_world_size()
    line = dist.init_device_mesh("cpu", (n,), mesh_dim_names=("w",))
    made = []
    for a, b in [(a, n // a) for a in range(1, n + 1) if n % a == 0]:
        u = line._unflatten("w", (a, b), ("x", "y"))
        made.append(u)
        assert u.shape == (a, b) and u.mesh_dim_names == ("x", "y")
        assert u.mesh.tolist() == np.arange(n).reshape(a, b).tolist()
        assert u.get_coordinate() == (me // b, me % b)
        assert u._get_root_mesh() is line
        for d, name in enumerate(("x", "y")):
            want = ref.group_of(ref.mesh_groups((a, b), (d,)), me)
            assert u.get_group(name).ranks == want
            assert _sum_of_ranks(dist, u.get_group(name)) == sum(want)
            # a new group unless it spans the world (WORLD itself, as in torch)
            assert (u.get_group(name) is dist.GroupMember.WORLD) == (len(want) == n)
        swapped = dist.DeviceMesh._concatenate([u["y"], u["x"]])
        assert swapped.shape == (b, a) and swapped.mesh_dim_names == ("y", "x")
        assert swapped.mesh.tolist() == np.arange(n).reshape(a, b).T.tolist()
        assert swapped.get_coordinate() == (me % b, me // b)
        assert swapped.get_all_groups() == [u.get_group("y"), u.get_group("x")]
        assert all(p is q for p, q in zip(swapped.get_all_groups(),
                                           [u.get_group("y"), u.get_group("x")]))
        assert swapped._get_root_mesh() is line
        again = u._unflatten("x", (a, 1), ("x0", "x1"))  # a dimension of size 1 added
        assert again.shape == (a, 1, b) and again.get_group("y") is u.get_group("y")
        assert again.get_group("x1").ranks == [me]
    with pytest.raises(ValueError, match=rf"sizes \({n + 1}, 1\) hold {n + 1} elements"):
        line._unflatten(0, (n + 1, 1), ("p", "q"))
    with pytest.raises(ValueError, match="dim 'v' is not one of mesh_dim_names"):
        line._unflatten("v", (n,), ("p",))
    with pytest.raises(ValueError, match="dim 1 is out of range for a 1-D mesh"):
        line._unflatten(1, (n,), ("p",))
    with pytest.raises(ValueError, match="has 1 names, expected one per mesh dimension"):
        line._unflatten(0, (n, 1), ("p",))
    with pytest.raises(ValueError, match=r"repeats \['p'\]"):
        line._unflatten(0, (n, 1), ("p", "p"))
    # names must stay unique (torch lets a repeated name through; spmd refuses it)
    with pytest.raises(ValueError, match=r"repeats \['y'\]"):
        dist.DeviceMesh._concatenate([made[0]["y"], made[-1]["y"]])
    if n > 1:  # at one rank every dimension has size 1, and nothing can overlap
        with pytest.raises(RuntimeError, match="cannot concatenate overlapping meshes"):
            dist.DeviceMesh._concatenate([made[-1], line])
        other = dist.DeviceMesh("cpu", list(range(n))[::-1], mesh_dim_names=("r",))
        with pytest.raises(RuntimeError, match="derived from different device meshes"):
            dist.DeviceMesh._concatenate([line, other])
        _free(dist, other)
    _free(dist, line)


class _CountingComm:
    """Stands in for WORLD's communicator and counts Comm.Split calls."""

    def __init__(self, comm):
        self.comm, self.splits = comm, 0

    def Split(self, *args):
        self.splits += 1
        return self.comm.Split(*args)

    def __getattr__(self, name):
        return getattr(self.comm, name)


@pytest.mark.mpi
def test_one_split_per_dimension(dist):
    n = dist.get_world_size()
    world = dist.GroupMember.WORLD
    for shape in ref.shapes(n):
        counting = _CountingComm(world.context.comm)
        world.context.comm = counting
        try:
            mesh = dist.init_device_mesh("cpu", shape)
        finally:
            world.context.comm = counting.comm
        # A dimension of size 1 needs no message, one spanning the world is WORLD itself.
        assert counting.splits == sum(1 for s in shape if s not in (1, n)), shape
        assert counting.splits <= len(shape)  # never one per group
        _free(dist, mesh)


@pytest.mark.mpi
def test_explicit_mesh_and_non_members(dist):
    me, n = dist.get_rank(), dist.get_world_size()
    mesh = dist.DeviceMesh("cpu", list(range(n))[::-1], mesh_dim_names=("x",))
    assert mesh.get_coordinate() == (n - 1 - me,)
    assert mesh.get_group().ranks == list(range(n))  # group ranks follow global ranks
    _free(dist, mesh)
    if n == 1:
        pytest.skip("a mesh leaving some rank out needs 2 ranks or more")
    part = dist.DeviceMesh("cpu", [list(range(n - 1))], mesh_dim_names=("one", "rest"))
    if me == n - 1:
        assert part.get_coordinate() is None
        with pytest.raises(RuntimeError, match="not in the mesh"):
            part.get_group("rest")
    else:
        assert part.get_coordinate() == (0, me)
        assert part.get_group("rest").ranks == list(range(n - 1))
        assert _sum_of_ranks(dist, part.get_group("rest")) == sum(range(n - 1))
    _free(dist, part)


@pytest.mark.mpi
def test_from_group(dist):
    me, n = dist.get_rank(), dist.get_world_size()
    world = dist.GroupMember.WORLD
    one = dist.DeviceMesh.from_group(world, "cpu", mesh_dim_names=("w",))
    assert one.get_group() is world and one.mesh.tolist() == list(range(n))
    assert one.get_coordinate() == (me,)
    shape = (n, 1)
    made = dist.init_device_mesh("cpu", shape, mesh_dim_names=("r", "c"))
    again = dist.DeviceMesh.from_group(made.get_all_groups(), "cpu",
                                       np.arange(n).reshape(shape), mesh_dim_names=("r", "c"))
    assert again.get_all_groups() == made.get_all_groups()
    assert again.get_coordinate() == made.get_coordinate()
    with pytest.raises(ValueError, match="mesh and mesh_dim_names are required"):
        dist.DeviceMesh.from_group(made.get_all_groups(), "cpu")
    with pytest.raises(ValueError, match="does not match"):
        dist.DeviceMesh.from_group(world, "cpu", mesh=list(range(n + 1)))
    if n > 1:
        with pytest.raises(ValueError, match="along dimension 0"):
            dist.DeviceMesh.from_group([made.get_group("c"), made.get_group("r")], "cpu",
                                       np.arange(n).reshape(shape), mesh_dim_names=("r", "c"))
    _free(dist, made)


@pytest.mark.mpi
def test_backend_override_makes_own_group(dist):
    n = dist.get_world_size()
    mesh = dist.init_device_mesh("cpu", (n,), mesh_dim_names=("w",), backend_override={"w": "mpi"})
    pg = mesh.get_group()
    assert pg is not dist.GroupMember.WORLD and pg.ranks == list(range(n))
    assert _sum_of_ranks(dist, pg) == sum(range(n))
    with pytest.raises(ValueError, match="backend_override key 'q'"):
        dist.init_device_mesh("cpu", (n,), mesh_dim_names=("w",), backend_override={"q": "mpi"})
    _free(dist, mesh)


@pytest.mark.mpi
def test_bad_shapes_and_names(dist):
    n = dist.get_world_size()
    with pytest.raises(ValueError, match=rf"holds {2 * n} ranks, expected the world size \({n}\)"):
        dist.init_device_mesh("cpu", (2, n))
    with pytest.raises(ValueError, match=r"must hold positive ints, got 0"):
        dist.init_device_mesh("cpu", (0, n))
    with pytest.raises(ValueError, match=r"repeats \['x'\]; names must be unique"):
        dist.init_device_mesh("cpu", (1, n), mesh_dim_names=("x", "x"))
    with pytest.raises(ValueError, match=r"has 1 names, expected one per mesh dimension \(2\)"):
        dist.init_device_mesh("cpu", (1, n), mesh_dim_names=("x",))
    with pytest.raises(ValueError, match=r"device_type must be one of \('cpu', 'cuda'\), got "
                                         r"'cuda:0' \(without a device index"):
        dist.init_device_mesh("cuda:0", (n,))
    with pytest.raises(ValueError, match="rank -1 more than once|expected ranks in"):
        dist.DeviceMesh("cpu", [-1])
    with pytest.raises(ValueError, match="more than once"):
        dist.DeviceMesh("cpu", [0, 0])


@pytest.mark.mpi
def test_bad_dimension_lookups(dist):
    n = dist.get_world_size()
    mesh = dist.init_device_mesh("cpu", (1, n), mesh_dim_names=("dp", "tp"))
    for bad in ("pp", ("dp", "dp")):
        with pytest.raises(KeyError):
            mesh[bad]
        with pytest.raises(ValueError):  # also a ValueError (MeshDimError)
            mesh[bad]
    with pytest.raises(ValueError, match=r"no mesh dimension 'pp'; expected names from \['dp', 'tp'\]"):
        mesh["pp"]
    # torch's rule: dimensions in mesh order, where a dimension of size 1 may go anywhere
    assert mesh["tp", "dp"].shape == (n, 1)
    if n % 2 == 0 and n > 2:
        square = dist.init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("x", "y"))
        with pytest.raises(ValueError, match="must be given in mesh order"):
            square["y", "x"]
        _free(dist, square)
    with pytest.raises(RuntimeError, match="the mesh has 2 dimensions; pass mesh_dim"):
        mesh.get_group()
    with pytest.raises(ValueError, match="mesh_dim 2 is out of range for a 2-D mesh"):
        mesh.get_group(2)
    plain = dist.init_device_mesh("cpu", (n,))
    with pytest.raises(RuntimeError, match="without mesh_dim_names"):
        plain["x"]
    _free(dist, mesh, plain)


@pytest.mark.mpi
def test_repr_and_equality(dist):
    n = dist.get_world_size()
    a = dist.init_device_mesh("cpu", (1, n), mesh_dim_names=("dp", "tp"))
    assert repr(a) == f"DeviceMesh((dp=1, tp={n}), 'cpu')"
    assert a["tp"] == a["tp"] and hash(a["tp"]) == hash(a["tp"]) and a["tp"] != a["dp"]
    _free(dist, a)


