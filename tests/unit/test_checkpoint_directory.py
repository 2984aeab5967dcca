"""spmd.checkpoint.directory in one process: whole writes, the swap that makes a
temporary directory the checkpoint (and its roll-back), and the clean-up of what crashed
saves leave behind."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest

from spmd.checkpoint import directory


def make_ckpt(path, marker):
    os.mkdir(path)
    with open(os.path.join(path, "index.json"), "w") as f:
        f.write(marker)


def marker(path):
    with open(os.path.join(path, "index.json")) as f:
        return f.read()


# -- whole writes ------------------------------------------------------------------------


def test_short_writes_are_continued(tmp_path, monkeypatch):
    """os.write may take less than it is given: the rest follows, in pieces no larger
    than WRITE_CHUNK (2 GiB writes are split)."""
    real, sizes = os.write, []

    def write(fd, data):
        sizes.append(len(data))
        return real(fd, bytes(data[:3]))  # takes 3 bytes at most

    monkeypatch.setattr(directory, "WRITE_CHUNK", 5)
    monkeypatch.setattr(directory.os, "write", write)
    path = str(tmp_path / "f")
    data = bytes(range(23))
    directory.write_file(path, data, 0o600, sync=True)
    assert open(path, "rb").read() == data
    assert max(sizes) == 5 and len(sizes) == 8  # ceil(23 / 3) calls, none over the chunk


def test_write_that_moves_nothing_raises(tmp_path, monkeypatch):
    real = os.write
    monkeypatch.setattr(directory.os, "write",
                        lambda fd, data: real(fd, bytes(data[:4])) if len(data) == 10 else 0)
    path = str(tmp_path / "f")
    with pytest.raises(OSError, match=rf"No space left on device: wrote 4 of 10 bytes of "
                       rf"'{path}'") as info:
        directory.write_file(path, b"0123456789", 0o600, sync=False)
    assert info.value.errno == errno.ENOSPC


def test_file_size_limit_raises_efbig(tmp_path):
    """Past RLIMIT_FSIZE (SIGXFSZ ignored) a write is short, then fails with EFBIG: the
    error names the file and how far it got (in a child process: the limit is its own)."""
    path = str(tmp_path / "values.pkl")
    code = textwrap.dedent(f"""
        import resource, signal
        from spmd.checkpoint import directory
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        try:
            directory.write_file({path!r}, b"x" * 10000, 0o600, sync=False)
        except OSError as exc:
            print(exc.errno, exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (f"{errno.EFBIG} [Errno {errno.EFBIG}] File too large: wrote "
                                  f"4096 of 10000 bytes of '{path}'")


def test_size_check(tmp_path):
    path = str(tmp_path / "a.npy")
    with open(path, "wb") as f:
        f.write(b"x" * 10)
    directory.check_size(path, 10, "header 4 + data 6")
    with pytest.raises(OSError, match=r"a\.npy' is 10 bytes after the save, expected 12 "
                       r"\(header 4 \+ data 8\)"):
        directory.check_size(path, 12, "header 4 + data 8")


# -- the swap ----------------------------------------------------------------------------


def test_commit_to_a_new_path(tmp_path):
    tmp, path = str(tmp_path / "c.tmp-0123456789ab"), str(tmp_path / "c")
    make_ckpt(tmp, "new")
    assert directory.commit(tmp, path, True, sync=True) == []
    assert marker(path) == "new" and os.listdir(tmp_path) == ["c"]


@pytest.mark.parametrize("renameat2", [True, False], ids=["noreplace", "renames"])
def test_commit_without_replace_refuses_one_that_appeared(tmp_path, monkeypatch, renameat2):
    """Nothing was at the path when the save looked (overwrite=False); something is when
    it renames (an empty directory, which os.rename would replace): FileExistsError, and
    the temporary directory goes."""
    if not renameat2:
        monkeypatch.setattr(directory, "_renameat2", None)
    tmp, path = str(tmp_path / "c.tmp-0123456789ab"), str(tmp_path / "c")
    make_ckpt(tmp, "new")
    os.mkdir(path)
    with pytest.raises(FileExistsError, match=r"cannot rename .* to .*: File exists \(it "
                       r"appeared while the checkpoint was written\)"):
        directory.commit(tmp, path, False, sync=True)
    assert os.listdir(path) == [] and os.listdir(tmp_path) == ["c"]


@pytest.mark.parametrize("exchanges", [True, False], ids=["exchange", "renames"])
def test_commit_replaces(tmp_path, monkeypatch, exchanges):
    if not exchanges:
        monkeypatch.setattr(directory, "_renameat2", None)
    tmp, path = str(tmp_path / "c.tmp-0123456789ab"), str(tmp_path / "c")
    make_ckpt(tmp, "new")
    make_ckpt(path, "old")
    assert directory.commit(tmp, path, True, sync=True) == []
    assert marker(path) == "new" and os.listdir(tmp_path) == ["c"]


def test_exchange_swaps_files_and_directories(tmp_path):
    """renameat2(RENAME_EXCHANGE) on this machine's file system (Linux: ext4, tmpfs,
    xfs, btrfs have it)."""
    if sys.platform != "linux":
        assert directory._renameat2 is None or not directory.exchange("a", "b")
        return
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    make_ckpt(a, "A")
    with open(b, "w") as f:
        f.write("B")
    assert directory.exchange(a, b) is True
    assert os.path.isfile(a) and marker(b) == "A"
    with pytest.raises(FileNotFoundError):
        directory.exchange(a, str(tmp_path / "missing"))


def test_exchange_not_supported_falls_back(tmp_path, monkeypatch):
    """A file system that answers EINVAL to RENAME_EXCHANGE: the renames take over."""
    def renameat2(*args):
        import ctypes
        ctypes.set_errno(errno.EINVAL)
        return -1
    monkeypatch.setattr(directory, "_renameat2", renameat2)
    tmp, path = str(tmp_path / "c.tmp-0123456789ab"), str(tmp_path / "c")
    make_ckpt(tmp, "new")
    make_ckpt(path, "old")
    assert directory.commit(tmp, path, True, sync=False) == []
    assert marker(path) == "new" and os.listdir(tmp_path) == ["c"]


def failing_rename(monkeypatch, fail):
    real = os.rename

    def rename(src, dst):
        if fail(str(src), str(dst)):
            raise OSError(errno.EIO, "simulated", src, None, dst)
        real(src, dst)
    monkeypatch.setattr(directory.os, "rename", rename)


def test_second_rename_rolled_back(tmp_path, monkeypatch):
    monkeypatch.setattr(directory, "_renameat2", None)
    failing_rename(monkeypatch, lambda src, dst: ".tmp-" in src)
    tmp, path = str(tmp_path / "c.tmp-0123456789ab"), str(tmp_path / "c")
    make_ckpt(tmp, "new")
    make_ckpt(path, "old")
    with pytest.raises(OSError, match=r"simulated; the previous checkpoint is back at"):
        directory.commit(tmp, path, True, sync=True)
    assert marker(path) == "old" and os.listdir(tmp_path) == ["c"]


def test_failed_roll_back_names_both(tmp_path, monkeypatch):
    monkeypatch.setattr(directory, "_renameat2", None)
    failing_rename(monkeypatch, lambda src, dst: ".tmp-" in src or ".old-" in src)
    tmp, path = str(tmp_path / "c.tmp-0123456789ab"), str(tmp_path / "c")
    make_ckpt(tmp, "new")
    make_ckpt(path, "old")
    with pytest.raises(OSError, match=r"could not be renamed back \(simulated\): it is at "
                       r"'.*c\.old-[0-9a-f]{12}', the new one at '.*c\.tmp-0123456789ab'"):
        directory.commit(tmp, path, True, sync=True)
    names = sorted(os.listdir(tmp_path))
    assert names[0] == "c.old-" + names[0][-12:] and names[1] == "c.tmp-0123456789ab"
    assert marker(str(tmp_path / names[0])) == "old" and marker(tmp) == "new"


@pytest.mark.parametrize("exchanges", [True, False], ids=["exchange", "renames"])
def test_unsynced_swap_undone(tmp_path, monkeypatch, exchanges):
    if not exchanges:
        monkeypatch.setattr(directory, "_renameat2", None)

    def sync_dir(p):
        raise OSError(errno.EIO, "simulated fsync")
    monkeypatch.setattr(directory, "sync_dir", sync_dir)
    tmp, path = str(tmp_path / "c.tmp-0123456789ab"), str(tmp_path / "c")
    make_ckpt(tmp, "new")
    make_ckpt(path, "old")
    with pytest.raises(OSError, match=r"simulated fsync; the previous checkpoint is back"):
        directory.commit(tmp, path, True, sync=True)
    assert marker(path) == "old" and os.listdir(tmp_path) == ["c"]


def test_old_checkpoint_that_cannot_be_removed_is_reported(tmp_path, monkeypatch):
    tmp, path = str(tmp_path / "c.tmp-0123456789ab"), str(tmp_path / "c")
    make_ckpt(tmp, "new")
    make_ckpt(path, "old")

    def remove(p):
        raise PermissionError(errno.EACCES, "simulated", p)
    monkeypatch.setattr(directory, "remove", remove)
    notes = directory.commit(tmp, path, True, sync=False)
    assert marker(path) == "new"
    assert len(notes) == 1 and "could not be removed" in notes[0] and "next save" in notes[0]


# -- leftovers of crashed saves ----------------------------------------------------------


def test_clean_stale(tmp_path):
    path = str(tmp_path / "c")
    make_ckpt(path, "current")
    removed = ["c.tmp-0123456789ab", "c.old-0123456789ab"]
    kept = ["c.tmp-0123456789abc", "c.tmp-XYZ456789abc", "x.tmp-0123456789ab", "c"]
    for name in removed + kept[:-1]:
        make_ckpt(str(tmp_path / name), "leftover")
    with open(tmp_path / "c.tmp-aaaaaaaaaaaa", "w") as f:  # a file, not a save's directory
        f.write("?")
    notes = directory.clean_stale(path)
    assert sorted(os.listdir(tmp_path)) == sorted(kept + ["c.tmp-aaaaaaaaaaaa"])
    assert len(notes) == 1 and "c.tmp-aaaaaaaaaaaa' is not a directory" in notes[0]


def test_clean_stale_keeps_what_a_running_save_holds(tmp_path):
    path = str(tmp_path / "c")
    held = str(tmp_path / "c.tmp-00000000beef")
    fd = directory.make_tmp(held, 0o700)
    try:
        notes = directory.clean_stale(path)
        assert os.path.isdir(held)
        assert notes == [f"{held!r} is in use by a save still running; left as it is"]
    finally:
        os.close(fd)
    assert directory.clean_stale(path) == [] and not os.path.exists(held)


def test_clean_stale_keeps_the_only_copy(tmp_path):
    """Nothing at the path and an .old-* beside it: the previous checkpoint of a
    replacement that was cut short, kept; an .tmp-* then is an incomplete save, removed."""
    path = str(tmp_path / "c")
    old = str(tmp_path / "c.old-0123456789ab")
    make_ckpt(old, "previous")
    make_ckpt(str(tmp_path / "c.tmp-0123456789ab"), "partial")
    notes = directory.clean_stale(path)
    assert os.listdir(tmp_path) == ["c.old-0123456789ab"]
    assert len(notes) == 1 and "holds the checkpoint an interrupted save was replacing" in notes[0]


def test_clean_stale_without_flock_reports(tmp_path, monkeypatch):
    """A file system without flock: nobody can tell whether a save still runs, so the
    leftover stays and is reported."""
    make_ckpt(str(tmp_path / "c.tmp-0123456789ab"), "?")

    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(directory.fcntl, "flock", flock)
    notes = directory.clean_stale(str(tmp_path / "c"))
    assert os.listdir(tmp_path) == ["c.tmp-0123456789ab"]
    assert notes == [f"cannot tell whether a save still writes "
                     f"{str(tmp_path / 'c.tmp-0123456789ab')!r} (flock: No locks available); "
                     "left as it is"]
