"""spmd.checkpoint when things go wrong: no room (a file size limit), a short count,
failed renames, truncated or crafted files, and what crashed saves leave behind.

Every case checks the same thing on every rank: the error names the file and what was
expected, and the checkpoint that was at the path before still loads with its values."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import resource
import shutil
import signal
import tempfile
import warnings

import numpy as np
import pytest
from mpi4py import MPI

from spmd import checkpoint as ckpt
from spmd.checkpoint import directory, save_load
from spmd.checkpoint import index as ckpt_index
from spmd.checkpoint import mpiio as _mpiio

pytestmark = pytest.mark.mpi

LIMIT = 1 << 20      # the file size limit of the no-room cases
OLD = {"w": np.arange(12.0).reshape(4, 3), "step": 1, "extra": (1, 2)}


@pytest.fixture
def where(dist):
    """A fresh directory every rank sees (rank 0 makes it, the others are told)."""
    box = [tempfile.mkdtemp(prefix="spmd-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    yield box[0]
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(box[0], ignore_errors=True)


def rows(n_rows, rank, size):
    base, extra = divmod(n_rows, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def save_old(dist, where):
    """The checkpoint every failure must leave intact."""
    path = os.path.join(where, "c")
    ckpt.save(OLD, path)
    return path


def assert_old_intact(dist, where, path):
    """Every rank loads the previous checkpoint's values, and nothing else is left."""
    dist.barrier()
    got = ckpt.load({"w": None, "step": None, "extra": None}, path)
    np.testing.assert_array_equal(got["w"], OLD["w"])
    assert got["step"] == 1 and got["extra"] == (1, 2)
    assert sorted(os.listdir(where)) == ["c"], os.listdir(where)


def found_on(dist, rank):
    return "" if dist.get_world_size() == 1 else rf" \(found on group rank {rank}\)"


def on_rank0_warns(dist, match):
    """pytest.warns on rank 0 (which cleans and commits), nothing expected elsewhere."""
    if dist.get_rank() == 0:
        return pytest.warns(RuntimeWarning, match=match)
    return contextlib.nullcontext()


@contextlib.contextmanager
def file_size_limit(nbytes):
    """RLIMIT_FSIZE for this process, SIGXFSZ ignored so a write past it fails with EFBIG
    instead of killing the rank."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def refuse_fallocate(monkeypatch):
    """A file system that cannot preallocate: the data's room is found by the writes."""
    def fallocate(fd, mode, offset, nbytes):
        import ctypes
        ctypes.set_errno(errno.EOPNOTSUPP)
        return -1
    monkeypatch.setattr(_mpiio, "_fallocate", fallocate)


def big_rows(dist):
    """A float32 array of 2 MiB, rows split over the ranks: past LIMIT."""
    rank, n = dist.get_rank(), dist.get_world_size()
    lo, hi = rows(2048, rank, n)
    return ckpt.Shard(np.full((hi - lo, 256), rank, np.float32), (2048, 256), (lo, 0))


# -- no room: every rank raises, the previous checkpoint stays ----------------------------


def test_value_past_the_file_size_limit(dist, where):
    """values.pkl over RLIMIT_FSIZE: the short write is caught (it was committed
    truncated before), every rank raises naming the file and how far it got."""
    path = save_old(dist, where)
    new = {"w": np.zeros((4, 3)), "step": 2, "extra": b"x" * (2 * LIMIT)}
    with file_size_limit(LIMIT), pytest.raises(
            OSError, match=r"checkpoint.save: cannot create .*File too large: wrote "
            rf"{LIMIT} of \d+ bytes of '.*values\.pkl'{found_on(dist, 0)} \[rank "
            rf"{dist.get_rank()}, group WORLD\]"):
        ckpt.save(new, path, overwrite=True)
    assert_old_intact(dist, where, path)


def test_array_past_the_file_size_limit(dist, where):
    """An array over RLIMIT_FSIZE where the file system preallocates: refused when its
    file is made, before any data is written."""
    path = save_old(dist, where)
    with file_size_limit(LIMIT), pytest.raises(
            OSError, match=r"checkpoint.save: cannot create .*File too large: the 2097152 "
            r"bytes of data of '.*big\.npy' do not fit"):
        ckpt.save({**OLD, "big": big_rows(dist)}, path, overwrite=True)
    assert_old_intact(dist, where, path)


def test_array_past_the_file_size_limit_without_preallocation(dist, where, monkeypatch):
    """The same where nothing is preallocated: the MPI-IO write past the limit fails on
    the ranks whose rows lie beyond it, and every rank raises."""
    refuse_fallocate(monkeypatch)
    path = save_old(dist, where)
    found = "" if dist.get_world_size() == 1 else r" \(found on group rank \d\)"
    with file_size_limit(LIMIT), pytest.raises(
            OSError, match=r"checkpoint.save: cannot write into .*Write_at of \d+ bytes of "
            # MPI's reason (MPICH: "File too large"; Open MPI: "MPI_ERR_OTHER")
            rf"'.*big\.npy' failed: .+{found} \[rank {dist.get_rank()}"):
        ckpt.save({**OLD, "big": big_rows(dist)}, path, overwrite=True)
    assert_old_intact(dist, where, path)


def test_short_mpiio_count_refused(dist, where, monkeypatch):
    """A write MPI reports as shorter than asked, on the last rank only: every rank
    raises, naming that rank, the file and the counts."""
    rank, n = dist.get_rank(), dist.get_world_size()
    path = save_old(dist, where)
    real = _mpiio._checked

    def checked(access, at, spec, nbytes, fpath):
        if rank == n - 1 and fpath.endswith("w.npy") and access.__name__ == "Write_at":
            def Write_at(at, spec, status):  # noqa: N802 - named like the MPI call
                access(at, spec, status)
                # MPI said: 8 bytes went out.  Set in bytes: Intel MPI counts a derived
                # type's elements here as whole types (8 of them, 64 bytes), MPICH and
                # Open MPI as its basic elements.
                status.Set_elements(MPI.BYTE, 8)
            return real(Write_at, at, spec, nbytes, fpath)
        return real(access, at, spec, nbytes, fpath)

    monkeypatch.setattr(_mpiio, "_checked", checked)
    lo, hi = rows(4, rank, n)
    w = ckpt.Shard(np.ones((hi - lo, 3)), (4, 3), (lo, 0))
    last_lo, last_hi = rows(4, n - 1, n)
    with pytest.raises(OSError, match=r"checkpoint.save: cannot write into .*wrote 8 of the "
                       rf"{(last_hi - last_lo) * 24} bytes of this rank's block of '.*w\.npy'"
                       + found_on(dist, n - 1)):
        ckpt.save({"w": w, "step": 2, "extra": ()}, path, overwrite=True)
    monkeypatch.undo()
    assert_old_intact(dist, where, path)


def test_file_of_the_wrong_size_never_committed(dist, where, monkeypatch):
    """A .npy file that comes out shorter than its header says (a write lost without an
    error): the size check before the index refuses it on every rank."""
    refuse_fallocate(monkeypatch)
    path = save_old(dist, where)
    real = save_load.write_blocks

    def write_blocks(comm, writes, sync=False):
        real(comm, writes, sync)
        comm.Barrier()
        if comm.Get_rank() == 0:
            w = next(w for w in writes if w.path.endswith("w.npy"))
            os.truncate(w.path, os.path.getsize(w.path) - 8)

    monkeypatch.setattr(save_load, "write_blocks", write_blocks)
    with pytest.raises(OSError, match=r"checkpoint.save: a file in .* came out wrong: .*'.*w\.npy'"
                       r" is 216 bytes after the save, expected 224 \(header 128 \+ data 96\)"):
        ckpt.save({"w": np.ones((4, 3)), "step": 2, "extra": ()}, path, overwrite=True)
    assert_old_intact(dist, where, path)


# -- replacing a checkpoint: atomic, or rolled back -------------------------------------


def test_overwrite_exchanges_atomically(dist, where, monkeypatch):
    """On Linux the new directory and the old one are swapped in one renameat2: no
    rename of the old one out of the way happens."""
    path = save_old(dist, where)
    calls, renames = [], []
    real_exchange, real_rename = directory.exchange, os.rename
    monkeypatch.setattr(directory, "exchange",
                        lambda a, b: calls.append(real_exchange(a, b)) or calls[-1])
    monkeypatch.setattr(directory.os, "rename",
                        lambda a, b: renames.append((a, b)) or real_rename(a, b))
    ckpt.save({"w": np.ones((4, 3)), "step": 2, "extra": ()}, path, overwrite=True)
    if dist.get_rank() == 0:
        assert calls == [True] and renames == []
    assert ckpt.load({"step": None}, path)["step"] == 2
    assert sorted(os.listdir(where)) == ["c"]


def test_failed_exchange_leaves_the_old_checkpoint(dist, where, monkeypatch):
    path = save_old(dist, where)

    def exchange(a, b):
        raise OSError(errno.EIO, "simulated exchange failure")

    monkeypatch.setattr(directory, "exchange", exchange)
    with pytest.raises(OSError, match=r"checkpoint.save: .*cannot exchange .* with '.*c': "
                       r"simulated exchange failure; the previous checkpoint is still at"):
        ckpt.save({"w": np.zeros((4, 3)), "step": 2, "extra": ()}, path, overwrite=True)
    assert_old_intact(dist, where, path)


def no_exchange(monkeypatch):
    """An OS or file system without renameat2(RENAME_EXCHANGE)."""
    monkeypatch.setattr(directory, "_renameat2", None)


def failing_rename(monkeypatch, fail):
    """os.rename that fails (EIO) for the calls ``fail(src, dst)`` picks."""
    real = os.rename

    def rename(src, dst):
        if fail(str(src), str(dst)):
            raise OSError(errno.EIO, "simulated rename failure", src, None, dst)
        real(src, dst)
    monkeypatch.setattr(directory.os, "rename", rename)


def test_replace_without_exchange(dist, where, monkeypatch):
    """Without RENAME_EXCHANGE: two renames, and no .old-* directory left."""
    no_exchange(monkeypatch)
    path = save_old(dist, where)
    ckpt.save({"w": np.zeros((4, 3)), "step": 2, "extra": ()}, path, overwrite=True)
    assert ckpt.load({"step": None}, path)["step"] == 2
    assert sorted(os.listdir(where)) == ["c"]


def test_second_rename_fails_rolled_back(dist, where, monkeypatch):
    """Without RENAME_EXCHANGE the new directory's rename fails after the old one moved
    out of the way: the old one is renamed back, every rank raises."""
    no_exchange(monkeypatch)
    path = save_old(dist, where)
    failing_rename(monkeypatch, lambda src, dst: ".tmp-" in src)
    with pytest.raises(OSError, match=r"cannot rename '.*c\.tmp-[0-9a-f]{12}' to '.*c': "
                       r"simulated rename failure; the previous checkpoint is back at"):
        ckpt.save({"w": np.zeros((4, 3)), "step": 2, "extra": ()}, path, overwrite=True)
    assert_old_intact(dist, where, path)


def test_rollback_that_fails_says_where_the_checkpoints_are(dist, where, monkeypatch):
    """The rename back fails too: the error names the .old-* directory; load points
    there; the next save keeps it (it is the only copy) and says so; the one after
    that, with a checkpoint at the path again, removes it."""
    no_exchange(monkeypatch)
    path = save_old(dist, where)
    failing_rename(monkeypatch, lambda src, dst: ".tmp-" in src or ".old-" in src)
    with pytest.raises(OSError, match=r"could not be renamed back \(simulated rename failure"
                       r"\): it is at '.*c\.old-[0-9a-f]{12}', the new one at "):
        ckpt.save({"w": np.zeros((4, 3)), "step": 2, "extra": ()}, path, overwrite=True)
    monkeypatch.undo()
    dist.barrier()
    assert not os.path.exists(path)
    with pytest.raises(FileNotFoundError, match=r"left the previous checkpoint at "
                       r"'.*c\.old-[0-9a-f]{12}'"):
        ckpt.load({"step": None}, path)
    old = [n for n in os.listdir(where) if ".old-" in n]
    assert len(old) == 1
    got = ckpt.load({"step": None, "w": None}, os.path.join(where, old[0]))
    assert got["step"] == 1  # the previous checkpoint, whole
    dist.barrier()
    with on_rank0_warns(dist, r"c\.old-[0-9a-f]{12}' holds the checkpoint an interrupted "
                        r"save was replacing"):
        ckpt.save({"w": np.ones((4, 3)), "step": 3, "extra": ()}, path)
    assert old[0] in os.listdir(where)
    # The leftovers of the failed save: its .tmp-* (the new one, never committed) is gone.
    assert sorted(os.listdir(where)) == sorted(["c", old[0]])
    ckpt.save({"w": np.ones((4, 3)), "step": 4, "extra": ()}, path, overwrite=True)
    assert sorted(os.listdir(where)) == ["c"]
    assert ckpt.load({"step": None}, path)["step"] == 4


@pytest.mark.parametrize("exchanges", [True, False], ids=["exchange", "renames"])
def test_unsynced_rename_rolled_back(dist, where, monkeypatch, exchanges):
    """The directory cannot be synced after the swap: the swap is undone, the previous
    checkpoint is back."""
    if not exchanges:
        no_exchange(monkeypatch)
    path = save_old(dist, where)

    def sync_dir(p):
        raise OSError(errno.EIO, "simulated fsync failure")

    monkeypatch.setattr(directory, "sync_dir", sync_dir)
    with pytest.raises(OSError, match=r"cannot sync the rename of .*: simulated fsync "
                       r"failure; the previous checkpoint is back at '.*c'"):
        ckpt.save({"w": np.zeros((4, 3)), "step": 2, "extra": ()}, path, overwrite=True)
    monkeypatch.undo()
    assert_old_intact(dist, where, path)


def test_path_that_appears_during_the_save_is_not_replaced(dist, where):
    """overwrite=False and an (empty) directory appears at the path while the save runs:
    FileExistsError on every rank, the directory is left alone, nothing else is left."""
    path = os.path.join(where, "c")

    def appear(stage):
        if stage == "renaming" and dist.get_rank() == 0:
            os.mkdir(path)

    save_load._fault_hook = appear
    try:
        with pytest.raises(FileExistsError, match=r"checkpoint.save: .*cannot rename .* to "
                           r"'.*c': File exists \(it appeared while the checkpoint was written"):
            ckpt.save(OLD, path)
    finally:
        save_load._fault_hook = None
    dist.barrier()
    assert os.listdir(where) == ["c"] and os.listdir(path) == []


# -- what crashed saves leave: removed by the next save, unless in use ------------------


def test_stale_leftovers_removed(dist, where):
    """``c.tmp-<hex>`` and ``c.old-<hex>`` directories of crashed saves go at the next
    save of ``c``; names that only look alike and other checkpoints' stay."""
    path = save_old(dist, where)
    mine = ["c.tmp-0123456789ab", "c.old-ba9876543210"]
    others = ["c.tmp-notspmds", "c.tmp-0123456789abc", "d.tmp-0123456789ab", "c.oldish"]
    if dist.get_rank() == 0:
        for name in mine + others:
            os.mkdir(os.path.join(where, name))
            with open(os.path.join(where, name, "a.npy"), "wb") as f:
                f.write(b"partial")
    dist.barrier()
    ckpt.save({"w": np.ones((4, 3)), "step": 2, "extra": ()}, path, overwrite=True)
    assert sorted(os.listdir(where)) == sorted(["c", *others])


def test_leftover_of_a_running_save_kept(dist, where):
    """A temporary directory whose save still runs (it holds the directory's lock) is
    kept, and rank 0 says so."""
    path = save_old(dist, where)
    held = os.path.join(where, "c.tmp-00000000beef")
    fd = None
    if dist.get_rank() == 0:
        fd = directory.make_tmp(held, 0o700)
    dist.barrier()
    try:
        with on_rank0_warns(dist, r"c\.tmp-00000000beef' is in use by a save still running"):
            ckpt.save({"w": np.ones((4, 3)), "step": 2, "extra": ()}, path, overwrite=True)
    finally:
        if fd is not None:
            os.close(fd)
    dist.barrier()
    assert sorted(os.listdir(where)) == ["c", "c.tmp-00000000beef"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # released: removed without a word
        ckpt.save({"w": np.ones((4, 3)), "step": 3, "extra": ()}, path, overwrite=True)
    assert sorted(os.listdir(where)) == ["c"]


def test_simulated_crash_leftover_removed_by_next_save(dist, where):
    """A save that stops before its rename leaves its .tmp-* directory (unlocked once
    the save is over); the next save of the path removes it."""
    path = os.path.join(where, "c")

    def crash(stage):
        if stage == "renaming":
            raise OSError("simulated crash before the rename")

    save_load._fault_hook = crash
    try:
        with pytest.raises(OSError, match="simulated crash"):
            ckpt.save(OLD, path)
    finally:
        save_load._fault_hook = None
    dist.barrier()
    assert [re.fullmatch(r"c\.tmp-[0-9a-f]{12}", n) is not None
            for n in os.listdir(where)] == [True]
    ckpt.save(OLD, path)
    assert_old_intact(dist, where, path)


# -- reading: truncated and crafted checkpoints are refused -------------------------------


def damage(dist, fn):
    """Rank 0 damages the checkpoint; the others wait until it has."""
    dist.barrier()
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def test_truncated_npy_refused(dist, where):
    path = save_old(dist, where)
    w = os.path.join(path, "w.npy")
    damage(dist, lambda: os.truncate(w, 128 + 96 - 8))
    with pytest.raises(ValueError, match=r"checkpoint.load: '.*w\.npy' is truncated: expected "
                       r"224 bytes \(header 128 \+ data 96\), got 216 bytes"):
        ckpt.load({"w": None}, path)
    damage(dist, lambda: os.truncate(w, 40))
    with pytest.raises(ValueError, match=r"cannot read the header of '.*w\.npy'"):
        ckpt.load({"w": None}, path)
    ckpt.save(OLD, path, overwrite=True)
    damage(dist, lambda: os.truncate(w, 60) or os.truncate(w, 128 + 96))  # a zeroed header
    with pytest.raises(ValueError, match=r"cannot read the header of '.*w\.npy'"):
        ckpt.load({"w": None}, path)
    ckpt.save(OLD, path, overwrite=True)
    damage(dist, lambda: os.truncate(w, 128 + 96 + 8))
    with pytest.raises(ValueError, match=r"'.*w\.npy' is longer than its header says: "
                       r"expected 224 bytes"):
        ckpt.load({"w": None}, path)


def test_short_read_count_refused(dist, where):
    """read_block checks the count MPI reports: a rank whose block runs past the end of
    a truncated file raises, naming the file and the counts (each rank reads alone here:
    the count of a collective read that reaches the end of the file is reported whole by
    some MPIs, see the next test)."""
    from mpi4py import MPI

    rank, n = dist.get_rank(), dist.get_world_size()
    path = save_old(dist, where)
    fname = os.path.join(path, "w.npy")
    damage(dist, lambda: os.truncate(fname, 128 + 96 - 8))
    lo, hi = rows(4, rank, n)
    out = np.zeros((hi - lo, 3))
    if hi == 4:  # the last rows: 8 of their bytes are gone
        want = (hi - lo) * 24
        with pytest.raises(OSError, match=rf"read {want - 8} of the {want} bytes of this rank's "
                           rf"block of '{re.escape(fname)}' \(the file is shorter than its "
                           r"header says\)"):
            _mpiio.read_block(MPI.COMM_SELF, fname, 128, (4, 3), 8, (lo, 0), out)
    else:
        _mpiio.read_block(MPI.COMM_SELF, fname, 128, (4, 3), 8, (lo, 0), out)
        np.testing.assert_array_equal(out, OLD["w"][lo:hi])


def test_file_shrunk_while_loading_refused_on_every_rank(dist, where, monkeypatch):
    """The file shrinks after the index was checked (that check skipped here): load
    raises on every rank, naming the file, the bytes expected and the bytes got (from
    the read's count, or from the size rank 0 finds after the reads where the MPI
    reports a collective read past the end of a file as whole)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    path = save_old(dist, where)
    damage(dist, lambda: os.truncate(os.path.join(path, "w.npy"), 128 + 96 - 8))
    monkeypatch.setattr(ckpt_index, "_check_npy", lambda fname, entry: 128)
    lo, hi = rows(4, rank, n)
    target = {"w": ckpt.Shard(np.zeros((hi - lo, 3)), (4, 3), (lo, 0))}
    with pytest.raises(OSError, match=r"checkpoint.load: cannot read '.*w\.npy': .*(read \d+ "
                       r"of the \d+ bytes of this rank's block|it changed while it was read: "
                       r"'.*w\.npy' is truncated: expected 224 bytes \(header 128 \+ data 96\),"
                       r" got 216 bytes)"):
        ckpt.load(target, path)


def test_truncated_or_damaged_values_refused(dist, where):
    path = save_old(dist, where)
    pkl = os.path.join(path, ckpt.VALUES_FILE)
    size = os.path.getsize(pkl)
    with open(pkl, "rb") as f:
        blob = f.read()
    damage(dist, lambda: os.truncate(pkl, size - 3))
    with pytest.raises(ValueError, match=rf"'.*values\.pkl' is truncated: expected {size} bytes "
                       rf"\(the index's record\), got {size - 3} bytes"):
        ckpt.load({"extra": None}, path)

    def flip():
        os.remove(pkl)
        with open(pkl, "wb") as f:
            f.write(blob[:-2] + bytes([blob[-2] ^ 0xFF]) + blob[-1:])
    damage(dist, flip)
    with pytest.raises(ValueError, match=r"values\.pkl' is damaged: its sha256 differs"):
        ckpt.load({"extra": None}, path)

    def old_format_truncated():  # an index written before the record: unpickling fails
        index_path = os.path.join(path, ckpt.INDEX_FILE)
        with open(index_path) as f:
            index = json.load(f)
        del index["values_pkl"]
        with open(index_path, "w") as f:
            json.dump(index, f)
        with open(pkl, "wb") as f:
            f.write(blob[:-3])
    damage(dist, old_format_truncated)
    with pytest.raises(ValueError, match=rf"cannot unpickle '.*values\.pkl' \({size - 3} bytes\)"):
        ckpt.load({"extra": None}, path)


def crafted(dist, path, **changes):
    """Rank 0 rewrites the index entry of ``w``."""
    def rewrite():
        index_path = os.path.join(path, ckpt.INDEX_FILE)
        with open(index_path) as f:
            index = json.load(f)
        index["entries"]["w"].update(changes)
        with open(index_path, "w") as f:
            json.dump(index, f)
    damage(dist, rewrite)


@pytest.mark.parametrize("changes, match", [
    ({"file": "../x.npy"}, r"entry 'w' names the file '\.\./x\.npy'; expected a plain file name inside"),
    ({"file": "/etc/passwd"}, r"entry 'w' names the file '/etc/passwd'; expected a plain file name"),
    ({"file": "sub/w.npy"}, r"entry 'w' names the file 'sub/w\.npy'"),
    ({"file": "link.npy"}, r"entry 'w' names the file 'link\.npy', which resolves to '.*x\.npy', outside "
                           r"the checkpoint directory"),
    ({"dtype": "object"}, r"entry 'w' has dtype 'object'; a checkpoint holds arrays of .*"
                          r"float64.* only"),
    ({"dtype": "float128"}, r"entry 'w' has dtype 'float128'"),
    ({"dtype": ["<f8"]}, r"entry 'w' has dtype \['<f8'\]"),
    ({"shape": [4, "3"]}, r"entry 'w' has shape \[4, '3'\]; expected a list of non-negative"),
])
def test_crafted_index_refused_before_any_read(dist, where, monkeypatch, changes, match):
    """An index naming a file outside the checkpoint (one that exists and would load),
    or a dtype save never writes: ValueError on every rank, and no file is opened."""
    path = save_old(dist, where)
    if dist.get_rank() == 0:
        shutil.copy(os.path.join(path, "w.npy"), os.path.join(where, "x.npy"))
        os.symlink(os.path.join(where, "x.npy"), os.path.join(path, "link.npy"))
    crafted(dist, path, **changes)
    opened = []
    monkeypatch.setattr(ckpt_index, "read_npy_header", lambda f: opened.append(f))
    monkeypatch.setattr(save_load, "read_block", lambda *a: opened.append(a))
    with pytest.raises(ValueError, match=r"checkpoint.load: '.*index\.json': " + match):
        ckpt.load({"w": None}, path)
    assert opened == []
