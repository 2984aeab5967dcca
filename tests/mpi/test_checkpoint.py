"""spmd.checkpoint under MPI: every rank saves its blocks, reads others' layouts back,
and checks the files against the global array with plain numpy."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import stat
import tempfile

import numpy as np
import pytest
from conftest import ml_dtypes

from spmd import checkpoint as ckpt
from spmd.checkpoint import mpiio as _mpiio
from spmd.checkpoint import save_load

pytestmark = pytest.mark.mpi


@pytest.fixture
def where(dist):
    """A fresh directory every rank sees (rank 0 makes it, the others are told)."""
    box = [tempfile.mkdtemp(prefix="spmd-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    yield box[0]
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(box[0], ignore_errors=True)


def global_array(shape, dtype, seed=0):
    """The same array on every rank, with values that differ element by element."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-100 if np.dtype(dtype).kind == "i" else 0, 100, shape).astype(dtype)
    a = rng.standard_normal(shape) * 10
    if np.dtype(dtype).kind == "c":
        a = a + 1j * rng.standard_normal(shape)
    return a.astype(dtype)


def rows(n_rows, rank, size):
    base, extra = divmod(n_rows, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


DTYPES = [np.float32, np.float64, np.float16, np.int64, np.uint8, np.bool_, np.complex64]
if ml_dtypes is not None:
    DTYPES.append(ml_dtypes.bfloat16)


def test_roundtrip_every_dtype(dist, where):
    """Rows split over the ranks, saved; the .npy files equal the global arrays on
    every rank, and load at a column split gives every rank its columns back."""
    rank, n = dist.get_rank(), dist.get_world_size()
    state, ref = {}, {}
    for k, dt in enumerate(DTYPES):
        g = global_array((7, 5), dt, seed=k)
        lo, hi = rows(7, rank, n)
        name = f"a_{np.dtype(dt).name}"
        state[name] = ckpt.Shard(g[lo:hi], (7, 5), (lo, 0))
        ref[name] = g
    state["step"], state["cfg"], state["shape"] = 1200, {"lr": 3e-4, "names": ["x"]}, (7, 5)
    path = os.path.join(where, "c")
    ckpt.save(state, path)
    with open(os.path.join(path, ckpt.INDEX_FILE)) as f:
        index = json.load(f)
    assert index["entries"]["step"] == {"kind": "value", "json": 1200}
    assert index["entries"]["shape"] == {"kind": "value", "pickle": True}  # a tuple
    for name, g in ref.items():
        on_disk = np.load(os.path.join(path, name + ".npy"))
        if g.dtype.name == "bfloat16":  # plain numpy sees 2-byte voids
            assert on_disk.dtype == np.dtype("V2")
            on_disk = on_disk.view(g.dtype)
        assert on_disk.dtype == g.dtype and on_disk.shape == g.shape
        np.testing.assert_array_equal(on_disk.view(np.uint8), g.view(np.uint8))
    target = {name: ckpt.Shard.empty((7, 5), g.dtype, dim=1) for name, g in ref.items()}
    target.update(step=None, cfg=None, shape=None)
    out = ckpt.load(target, path)
    assert out is target and out["step"] == 1200 and out["shape"] == (7, 5)
    assert out["cfg"] == {"lr": 3e-4, "names": ["x"]}
    for name, g in ref.items():
        s = target[name]
        lo = s.offset[1]
        np.testing.assert_array_equal(s.data.view(np.uint8),
                                      np.ascontiguousarray(g[:, lo:lo + s.shape[1]]).view(np.uint8))


def test_layouts_strided_replicated_nested(dist, where):
    """2-D blocks from a strided (Fortran-order) local array, a replicated array,
    a 0-d array, an empty array and nested dicts; read back whole, as blocks and as None."""
    rank, n = dist.get_rank(), dist.get_world_size()
    g = global_array((10, 6), np.float64)
    lo, hi = rows(10, rank, n)
    c = 3 if rank % 2 else 0
    # Each rank holds rows lo:hi split into two column halves: blocks of 2 dims.
    mine = np.asfortranarray(g[lo:hi])
    state = {
        "model": {"w": ckpt.Shard.split(mine, dim=0),
                  "half": {"h": ckpt.Shard(g[lo:hi, :3][:, ::-1][:, ::-1], (10, 3), (lo, 0)),
                           # negative strides: the values of g[lo:hi, 3:], stored reversed
                           "h2": ckpt.Shard(np.ascontiguousarray(g[lo:hi, 3:][::-1, ::-1])
                                            [::-1, ::-1], (10, 3), (lo, 0))}},
        "bias": np.arange(9, dtype=np.int32) * 7,
        "scalar": np.array(2.5),
        "nothing": np.zeros((0, 4), np.float32),
        "meta": {"epoch": 3},
    }
    path = os.path.join(where, "c")
    ckpt.save(state, path)
    names = sorted(os.listdir(path))
    assert names == ["bias.npy", ckpt.INDEX_FILE, "model.half.h.npy", "model.half.h2.npy",
                     "model.w.npy", "nothing.npy", "scalar.npy"]
    np.testing.assert_array_equal(np.load(os.path.join(path, "model.w.npy")), g)
    np.testing.assert_array_equal(np.load(os.path.join(path, "bias.npy")), state["bias"])
    assert np.load(os.path.join(path, "scalar.npy")) == 2.5
    assert np.load(os.path.join(path, "nothing.npy")).shape == (0, 4)
    h = np.load(os.path.join(path, "model.half.h.npy"))
    np.testing.assert_array_equal(h, g[:, :3])
    np.testing.assert_array_equal(np.load(os.path.join(path, "model.half.h2.npy")), g[:, 3:])

    # Read back: a strided target block (every other column of a 2-D block), whole arrays.
    col_lo = c
    block = np.zeros((10, 6))[::1, col_lo:col_lo + 3]
    target = {"model": {"w": ckpt.Shard(block, (10, 6), (0, col_lo)), "half": {"h": None,
                                                                               "h2": None}},
              "bias": np.empty(9, np.int32), "scalar": np.empty((), np.float64),
              "nothing": None, "meta": None}
    ckpt.load(target, path)
    np.testing.assert_array_equal(block, g[:, col_lo:col_lo + 3])
    np.testing.assert_array_equal(target["model"]["half"]["h"], g[:, :3])
    np.testing.assert_array_equal(target["bias"], state["bias"])
    assert target["scalar"] == 2.5 and target["nothing"].shape == (0, 4)
    assert target["meta"] == {"epoch": 3}


def test_mesh_replicas(dist, where):
    """Shards from a DeviceMesh: split over one mesh dimension, replicated along the
    other; replicas are identical blocks, written once."""
    n = dist.get_world_size()
    shape = (2, 2) if n == 4 else (n, 1)
    mesh = dist.init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    g = global_array((9, 4), np.float32)
    lo, hi = rows(9, mesh.get_local_rank("dp"), shape[0])
    s = ckpt.Shard.from_mesh(g[lo:hi].copy(), mesh, {0: "dp"})
    assert s.global_shape == (9, 4) and s.offset == (lo, 0)
    t_lo, t_hi = rows(4, mesh.get_local_rank("tp"), shape[1])
    s2 = ckpt.Shard.from_mesh(g[lo:hi, t_lo:t_hi].copy(), mesh, {0: "dp", 1: "tp"})
    assert s2.global_shape == (9, 4) and s2.offset == (lo, t_lo)
    path = os.path.join(where, "c")
    ckpt.save({"rep": s, "blocks": s2, "everywhere": ckpt.Shard(g, g.shape, (0, 0))}, path)
    for name in ("rep", "blocks", "everywhere"):
        np.testing.assert_array_equal(np.load(os.path.join(path, name + ".npy")), g)


def test_many_files_side_by_side_and_collective(dist, where, monkeypatch):
    """More byte-range files than are held open at once, written side by side (each
    rank starting at another file), mixed with column blocks (collective writes),
    a replicated 0-d array and a rank-less empty block: every file equals its array."""
    from spmd.checkpoint import mpiio as _mpiio
    monkeypatch.setattr(_mpiio, "OPEN_AT_ONCE", 3)
    batches, collective = [], []
    side_by_side, write_block = _mpiio._write_side_by_side, _mpiio.write_block
    monkeypatch.setattr(_mpiio, "_write_side_by_side",
                        lambda comm, w, sync: (batches.append(len(w)), side_by_side(comm, w, sync)))
    monkeypatch.setattr(_mpiio, "write_block",
                        lambda comm, path, *a: (collective.append(os.path.basename(path)),
                                                write_block(comm, path, *a)))
    rank, n = dist.get_rank(), dist.get_world_size()
    state, ref = {}, {}
    for k in range(8):
        g = global_array((9, 3 + k), np.float64 if k % 2 else np.int32, seed=k)
        ref[f"r{k}"] = g
        lo, hi = rows(9, rank, n)
        # every other file from a strided local array, which MPI reads in place
        local = g[lo:hi] if k % 3 else np.asfortranarray(g[lo:hi])
        state[f"r{k}"] = ckpt.Shard(local, g.shape, (lo, 0))
    for k in range(2):
        g = global_array((4, 7), np.float32, seed=10 + k)
        ref[f"c{k}"] = g
        lo, hi = rows(7, rank, n)
        state[f"c{k}"] = ckpt.Shard(g[:, lo:hi], g.shape, (0, lo))
    ref["zero_d"] = state["zero_d"] = np.array(7.5)
    ref["few_rows"] = state["few_rows"] = global_array((1, 5), np.int64, seed=20)
    path = os.path.join(where, "c")
    ckpt.save(state, path)
    for name, g in ref.items():
        np.testing.assert_array_equal(np.load(os.path.join(path, name + ".npy")), g)
    # 10 byte-range files in batches of 3; column blocks are strided unless one rank
    assert batches == [3, 3, 3, 1] if n > 1 else [3, 3, 3, 3]
    assert collective == (["c0.npy", "c1.npy"] if n > 1 else [])
    assert _mpiio.byte_range((9, 4), (2, 0), (3, 4))
    assert not _mpiio.byte_range((4, 7), (0, 2), (4, 3))
    assert _mpiio.byte_range((4, 7), (1, 2), (1, 3))  # part of one row


def test_permissions_and_overwrite(dist, where):
    path = os.path.join(where, "c")
    ckpt.save({"a": np.ones(3)}, path)
    assert stat.S_IMODE(os.stat(os.path.join(path, "a.npy")).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.join(path, ckpt.INDEX_FILE)).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    with pytest.raises(FileExistsError, match=r"checkpoint.save: path .* exists .*\[rank \d+, "
                       r"group WORLD\]"):
        ckpt.save({"a": np.zeros(3)}, path)
    ckpt.save({"a": np.full(3, 2.0)}, path, overwrite=True, mode=0o640)
    np.testing.assert_array_equal(np.load(os.path.join(path, "a.npy")), np.full(3, 2.0))
    assert stat.S_IMODE(os.stat(os.path.join(path, "a.npy")).st_mode) == 0o640
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o750
    dist.barrier()
    assert sorted(os.listdir(where)) == ["c"]  # no temporary or old directory left


def test_failure_before_rename_leaves_nothing_complete(dist, where):
    """A failure between writing and renaming: no checkpoint at path, load says so."""
    path = os.path.join(where, "c")

    def fail(stage):
        if stage == "renaming":
            raise OSError("simulated crash before the rename")

    save_load._fault_hook = fail
    try:
        with pytest.raises(OSError, match="simulated crash"):
            ckpt.save({"a": np.ones(5), "s": ckpt.Shard.split(np.ones(2))}, path)
    finally:
        save_load._fault_hook = None
    dist.barrier()
    assert not os.path.exists(path)
    left = os.listdir(where)
    assert len(left) == 1 and left[0].startswith("c.tmp-"), left
    with pytest.raises(FileNotFoundError, match=r"checkpoint.load: no checkpoint at .*index.json "
                       r"is missing.*\[rank \d+, group WORLD\]"):
        ckpt.load({"a": None}, path)
    ckpt.save({"a": np.ones(5)}, path)  # the leftover does not block the next save
    assert ckpt.load({"a": None}, path)["a"].tolist() == [1.0] * 5
    assert os.listdir(where) == ["c"]  # and the next save removed it


def test_index_failure_renames_nothing(dist, where, monkeypatch):
    """Rank 0 cannot write the index: every rank raises it, nothing is renamed, and the
    temporary directory is removed."""
    def no_index(tmp, *args):
        raise OSError(f"simulated: no room for the index in {tmp}")

    monkeypatch.setattr(save_load, "write_index", no_index)
    path = os.path.join(where, "c")
    with pytest.raises(OSError, match=r"checkpoint.save: cannot write the index in .*simulated"
                       rf".*\[rank {dist.get_rank()}, group WORLD\]"):
        ckpt.save({"a": np.ones(4)}, path)
    dist.barrier()
    assert os.listdir(where) == []


def test_write_failure_on_the_last_rank_reaches_every_rank(dist, where, monkeypatch):
    """A write that fails on the last rank only: every rank raises it, naming that rank;
    nothing is renamed, and the temporary directory is removed."""
    rank, n = dist.get_rank(), dist.get_world_size()
    real = _mpiio.write_blocks

    def write_blocks(comm, writes, sync=False):
        real(comm, writes, sync)
        if rank == n - 1:
            raise OSError("simulated: the disk went away")

    monkeypatch.setattr(save_load, "write_blocks", write_blocks)
    path = os.path.join(where, "c")
    where_found = "" if n == 1 else rf" \(found on group rank {n - 1}\)"
    with pytest.raises(OSError, match=r"checkpoint.save: cannot write into .*simulated: the "
                       rf"disk went away{where_found} \[rank {rank}, group WORLD\]"):
        ckpt.save({"a": ckpt.Shard.split(np.ones(3))}, path)
    dist.barrier()
    assert os.listdir(where) == []


def test_group_without_a_host_backend(dist, where):
    """A group whose only backend is for GPU arrays (as after init_process_group("nccl"))
    still saves and loads host arrays: the checkpoint's own messages are object
    collectives on the group's communicator."""
    rank, n = dist.get_rank(), dist.get_world_size()
    g = global_array((5, 3), np.int64)
    pg = dist.new_group(backend="cuda:mpi")
    lo, hi = rows(5, rank, n)
    path = os.path.join(where, "c")
    ckpt.save({"w": ckpt.Shard(g[lo:hi], g.shape, (lo, 0)), "step": 7}, path, group=pg)
    np.testing.assert_array_equal(np.load(os.path.join(path, "w.npy")), g)
    target = ckpt.load({"w": None, "step": None}, path, group=pg)
    np.testing.assert_array_equal(target["w"], g)
    assert target["step"] == 7


# -- the files' blocks are allocated before the ranks write ------------------------------

def test_data_blocks_allocated_when_the_file_is_made(dist, where):
    """create_npy writes the header and allocates the data's blocks (buffered writes into
    allocated blocks are faster, and a full disk fails before any rank writes): the file
    is as long as the array's .npy, its blocks are there, and it reads as zeros."""
    if dist.get_rank() == 0:  # can this file system preallocate at all?
        fd = os.open(os.path.join(where, "probe"), os.O_WRONLY | os.O_CREAT, 0o600)
        ok = _mpiio._fallocate is not None and _mpiio._fallocate(fd, 0, 0, 4096) == 0
        why = os.strerror(ctypes.get_errno()) if _mpiio._fallocate is not None else "no libc"
        os.close(fd)
        os.remove(os.path.join(where, "probe"))
    box = [(ok, why) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if not box[0][0]:
        pytest.skip(f"fallocate(2) refused on the file system of {where}: {box[0][1]}")
    path = os.path.join(where, "a.npy")
    if dist.get_rank() == 0:
        assert _mpiio.create_npy(path, np.dtype(np.float64), (300, 70), 0o600) == 128
    dist.barrier()
    st = os.stat(path)
    assert st.st_size == 128 + 300 * 70 * 8
    assert st.st_blocks * 512 >= 300 * 70 * 8
    assert stat.S_IMODE(st.st_mode) == 0o600
    np.testing.assert_array_equal(np.load(path), np.zeros((300, 70)))


def refusing_fallocate(err, allow=0):
    """A stand-in for libc's fallocate that allocates ``allow`` times, then fails with
    ``err``, as the real one does on a file system that cannot (EOPNOTSUPP) or a full
    disk (ENOSPC)."""
    real = _mpiio._fallocate

    def fallocate(fd, mode, offset, nbytes):
        nonlocal allow
        if allow > 0 and real is not None:
            allow -= 1
            return real(fd, mode, offset, nbytes)
        ctypes.set_errno(err)
        return -1
    return fallocate


def test_file_system_without_preallocation(dist, where, monkeypatch):
    """Where fallocate is refused, the writes allocate as they go: same files."""
    monkeypatch.setattr(_mpiio, "_fallocate", refusing_fallocate(errno.EOPNOTSUPP))
    rank, n = dist.get_rank(), dist.get_world_size()
    g = global_array((7, 6), np.float32)
    lo, hi = rows(7, rank, n)
    path = os.path.join(where, "c")
    ckpt.save({"w": ckpt.Shard(g[lo:hi], g.shape, (lo, 0)), "r": g[0]}, path)
    np.testing.assert_array_equal(np.load(os.path.join(path, "w.npy")), g)
    np.testing.assert_array_equal(np.load(os.path.join(path, "r.npy")), g[0])


def test_no_space_refused_before_any_write(dist, where, monkeypatch):
    """No room for an array's data: every rank raises the same OSError naming the file,
    before any rank wrote, and the temporary directory (whose allocated blocks would keep
    the disk full) is gone."""
    monkeypatch.setattr(_mpiio, "_fallocate", refusing_fallocate(errno.ENOSPC, allow=1))
    written = []
    monkeypatch.setattr(save_load, "write_blocks", lambda *a, **k: written.append(a))
    rank, n = dist.get_rank(), dist.get_world_size()
    lo, hi = rows(8, rank, n)
    state = {"a": ckpt.Shard.split(np.ones((hi - lo, 3))), "b": np.arange(5.0)}
    with pytest.raises(OSError, match=r"checkpoint.save: cannot create .*No space left on "
                       r"device: the 40 bytes of data of '.*b\.npy' do not fit.* \[rank "
                       rf"{rank}, group WORLD\]"):
        ckpt.save(state, os.path.join(where, "c"))
    assert written == []
    dist.barrier()
    assert os.listdir(where) == []
    monkeypatch.undo()
    ckpt.save(state, os.path.join(where, "c"))
    np.testing.assert_array_equal(np.load(os.path.join(where, "c", "b.npy")), np.arange(5.0))


# -- bad input: the same error on every rank, and nothing written -------------------------


def save_error(dist, where, state, exc, match):
    path = os.path.join(where, "bad")
    with pytest.raises(exc, match=match) as info:
        ckpt.save(state, path)
    assert f"[rank {dist.get_rank()}, group WORLD]" in str(info.value)
    dist.barrier()
    assert os.listdir(where) == []
    return str(info.value)


def test_save_gap_overlap_bounds(dist, where):
    rank, n = dist.get_rank(), dist.get_world_size()
    lo, hi = rows(8, rank, n)
    # The last rank forgets its last row: a gap.
    short = hi - 1 if rank == n - 1 else hi
    save_error(dist, where, {"w": ckpt.Shard(np.ones((short - lo, 2)), (8, 2), (lo, 0))},
               ValueError, r"checkpoint.save: state\['w'\]: the blocks of the ranks cover 14 of "
               r"the 16 elements")
    # The last rank sticks out of the array.
    over = 1 if rank == n - 1 else 0
    save_error(dist, where, {"w": ckpt.Shard(np.ones((hi - lo + over, 2)), (8, 2), (lo, 0))},
               ValueError, r"block .* does not fit in global_shape \(8, 2\)"
               + (rf" \(found on group rank {n - 1}\)" if n > 1 else ""))
    if n > 1:
        # Rank 1's block starts one row early: it overlaps rank 0's.
        start = lo - 1 if rank == 1 else lo
        save_error(dist, where, {"w": ckpt.Shard(np.ones((hi - start, 2)), (8, 2), (start, 0))},
                   ValueError, r"the block of rank 0 .* overlaps the block of rank 1")


def test_save_ranks_disagree(dist, where):
    rank, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        pytest.skip("needs two ranks to disagree")
    extra = {"x": 1} if rank == n - 1 else {}
    save_error(dist, where, {"a": np.ones(2), **extra}, ValueError,
               rf"same entries on every rank: group rank {n - 1} has extra \['x'\]")
    dt = np.float64 if rank == 1 else np.float32
    save_error(dist, where, {"a": np.ones(2, dt)}, ValueError,
               r"state\['a'\] is a array of dtype float64 .* on group rank 1 but a array of "
               r"dtype float32")


def test_save_bad_leaves(dist, where):
    save_error(dist, where, {"o": np.array([object()])}, TypeError, r"has dtype object")
    save_error(dist, where, {"a/b": np.ones(2)}, ValueError, r"not usable as a file name")
    save_error(dist, where, [np.ones(2)], TypeError, r"state must be a dict, got list")
    save_error(dist, where, {"f": lambda: 0}, TypeError, r"cannot be pickled")
    with pytest.raises(ValueError, match=r"mode must be permission bits .* got 4096"):
        ckpt.save({"a": np.ones(2)}, os.path.join(where, "m"), mode=0o10000)
    missing = os.path.join(where, "no", "such", "dir")
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        ckpt.save({"a": np.ones(2)}, missing)


def test_load_errors(dist, where):
    rank = dist.get_rank()
    path = os.path.join(where, "c")
    ckpt.save({"w": ckpt.Shard.split(np.ones((2, 3), np.float32)), "v": 1}, path)
    n = dist.get_world_size()
    cases = [
        ({"nope": None}, ValueError, r"the checkpoint has no entry 'nope'"),
        ({"w": ckpt.Shard.empty((2 * n, 3), np.float64)}, TypeError,
         r"target\['w'\] has dtype float64, the checkpoint holds float32"),
        ({"w": ckpt.Shard.empty((2 * n, 4), np.float32)}, ValueError,
         rf"global_shape \({2 * n}, 4\), the checkpoint holds \({2 * n}, 3\)"),
        ({"w": ckpt.Shard(np.empty((1, 3), np.float32), (2 * n, 3), (2 * n, 0))}, ValueError,
         r"does not fit"),
        ({"v": np.empty(1)}, TypeError, r"is an array but the checkpoint holds a value"),
        ({"w": 3}, TypeError, r"is a int, but the checkpoint holds an array"),
    ]
    for target, exc, match in cases:
        with pytest.raises(exc, match=match) as info:
            ckpt.load(target, path)
        assert f"[rank {rank}, group WORLD]" in str(info.value)
    # Only the last rank asks for a missing entry: every rank raises.
    with pytest.raises(ValueError, match="no entry 'nope'"):
        ckpt.load({"nope": None} if rank == n - 1 else {"v": None}, path)


def test_split_errors_everywhere(dist):
    rank, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        pytest.skip("needs two ranks to disagree")
    cols = 4 if rank == 1 else 3
    with pytest.raises(ValueError, match=r"must agree outside dim 0: group rank 1 has \(2, 4\)"):
        ckpt.Shard.split(np.ones((2, cols)), dim=0)
    with pytest.raises(ValueError, match=r"expected global_shape \(5, 3\)"):
        ckpt.Shard.split(np.ones((2, 3)), dim=0, global_shape=(5, 3))


def test_ranks_ask_for_different_entries(dist, where, groups):
    """A subgroup saves; ranks load different entries, in a group of another size."""
    pg = groups["parity"]
    path = os.path.join(where, "c")
    g = global_array((5, 3), np.float64)
    lo, hi = rows(5, pg.rank(), pg.size())
    if dist.get_rank() % 2 == 0:  # the even ranks save
        ckpt.save({"g": ckpt.Shard(g[lo:hi], g.shape, (lo, 0)), "k": np.arange(4)}, path,
                  group=pg)
    dist.barrier()
    target = {"g": None} if dist.get_rank() % 2 else {"k": None, "g": ckpt.Shard.empty(
        (5, 3), np.float64, dim=1)}
    ckpt.load(target, path)
    if "k" in target:
        np.testing.assert_array_equal(target["k"], np.arange(4))
        s = target["g"]
        np.testing.assert_array_equal(s.data, g[:, s.offset[1]:s.offset[1] + s.shape[1]])
    else:
        np.testing.assert_array_equal(target["g"], g)


def test_cupy_arrays_staged(dist, where):
    """cupy Shards are written through host memory and filled back on the device."""
    from _gpu_helpers import cupy

    cp = cupy()
    rank, n = dist.get_rank(), dist.get_world_size()
    g = global_array((6, 5), np.float32)
    lo, hi = rows(6, rank, n)
    path = os.path.join(where, "c")
    ckpt.save({"w": ckpt.Shard(cp.asarray(g[lo:hi]), g.shape, (lo, 0)),
               "r": cp.arange(4.0)}, path)
    np.testing.assert_array_equal(np.load(os.path.join(path, "w.npy")), g)
    block = cp.zeros((6, 5), np.float32)[:, 1:4]  # a strided device view
    target = {"w": ckpt.Shard(block, g.shape, (0, 1)), "r": cp.empty(4)}
    ckpt.load(target, path)
    np.testing.assert_array_equal(cp.asnumpy(block), g[:, 1:4])
    np.testing.assert_array_equal(cp.asnumpy(target["r"]), np.arange(4.0))
