"""Checkpoints across jobs (plain pytest; each job under a wall-clock limit): saved by
one world size and layout, loaded by another; a rank killed mid-save."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys

import numpy as np
import pytest
from _launch import mpiexec, run
from ckpt_job import global_arrays

PROGRAM = "tests/programs/ckpt_job.py"


def job(n, *args, timeout=90):
    return run(mpiexec(n, sys.executable, PROGRAM, *args), timeout=timeout)


def ok_lines(proc, n):
    found = sorted(re.findall(r"rank (\d+)/(\d+) ckpt_job OK", proc.stdout))
    return found == sorted((str(r), str(n)) for r in range(n))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("save_n, save_layout, load_n, load_layout", [
    (4, "rows", 3, "cols"),
    (4, "blocks", 3, "rows"),
    (3, "cols", 4, "blocks"),
    (2, "rows", 1, "cols"),
])
def test_reshard_across_world_sizes(tmp_path, save_n, save_layout, load_n, load_layout):
    path = str(tmp_path / "ckpt")
    saved = job(save_n, "save", path, save_layout)
    assert saved.returncode == 0 and ok_lines(saved, save_n), saved.stdout
    for name, g in global_arrays().items():  # plain numpy, no MPI: the global arrays
        on_disk = np.load(os.path.join(path, f"{name}.npy"), mmap_mode="r")
        assert on_disk.dtype == g.dtype
        np.testing.assert_array_equal(on_disk, g)
    loaded = job(load_n, "load", path, load_layout)
    assert loaded.returncode == 0 and ok_lines(loaded, load_n), loaded.stdout


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n, stage", [(3, "written"), (2, "renaming"), (1, "renaming")])
def test_killed_rank_leaves_no_checkpoint(tmp_path, n, stage):
    """SIGKILL on one rank after the arrays are written, or just before the rename:
    the job dies, nothing exists at the path, a load job says there is no checkpoint,
    and a later save to the same path succeeds."""
    path = str(tmp_path / "ckpt")
    crashed = job(n, "crash", path, stage)
    assert crashed.returncode != 0, crashed.stdout
    assert "should not have finished" not in crashed.stdout
    assert not os.path.exists(path)
    left = os.listdir(tmp_path)
    assert left and all(name.startswith("ckpt.tmp-") for name in left), left
    loaded = job(n, "load", path, "rows")
    assert loaded.returncode != 0
    assert "FileNotFoundError: checkpoint.load: no checkpoint at" in loaded.stdout, loaded.stdout
    saved = job(n, "save", path, "rows")
    assert saved.returncode == 0 and ok_lines(saved, n), saved.stdout
    assert os.listdir(tmp_path) == ["ckpt"]  # the crashed save's directory removed
    assert ok_lines(job(n, "load", path, "cols"), n)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n, stage", [(3, "written"), (2, "renaming")])
def test_killed_rank_keeps_the_previous_checkpoint(tmp_path, n, stage):
    """SIGKILL on one rank of a save that replaces a checkpoint: the previous one stays
    at the path (the same directory) and loads; the next save removes the leftover."""
    path = str(tmp_path / "ckpt")
    saved = job(n, "save", path, "rows")
    assert saved.returncode == 0 and ok_lines(saved, n), saved.stdout
    before = os.stat(path).st_ino
    crashed = job(n, "crash", path, stage)
    assert crashed.returncode != 0, crashed.stdout
    assert "should not have finished" not in crashed.stdout
    assert os.stat(path).st_ino == before
    left = sorted(os.listdir(tmp_path))
    assert left[0] == "ckpt" and len(left) == 2 and left[1].startswith("ckpt.tmp-"), left
    assert ok_lines(job(n, "load", path, "cols"), n)
    resaved = job(n, "save", path, "rows")
    assert resaved.returncode == 0 and ok_lines(resaved, n), resaved.stdout
    assert os.listdir(tmp_path) == ["ckpt"] and os.stat(path).st_ino != before
    assert ok_lines(job(n, "load", path, "blocks"), n)


def can_mount_privately(where):
    """Whether a tmpfs can be mounted at ``where`` in a mount namespace of its own."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    probe = f"mount -t tmpfs -o size=1m tmpfs {shlex.quote(str(where))}"
    return run(["unshare", "-m", "sh", "-c", probe], timeout=30).returncode == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1, 3])
def test_full_disk_refused_and_left_empty(tmp_path, n):
    """On a real full file system (a 3 MiB tmpfs in a mount namespace of the job's own),
    a save of two 2 MiB arrays fails on every rank when the second array's blocks do not
    fit, before anything is written, and removes what it had made: a save of one array
    fits afterwards, and only that checkpoint is left."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if not can_mount_privately(disk):
        pytest.skip("needs root, unshare and mount for a size-limited tmpfs")
    path = disk / "ckpt"
    # The limit inside: `unshare` becomes the shell, so the outer timeout would not
    # reach mpiexec and its ranks.
    cmd = " ".join(shlex.quote(a) for a in ["timeout", "-k", "5", "60",
                                            *mpiexec(n, sys.executable, PROGRAM, "fill",
                                                     str(path), "2")])
    script = (f"mount -t tmpfs -o size=3m tmpfs {shlex.quote(str(disk))} && {cmd}; rc=$?; "
              f"ls -A {shlex.quote(str(disk))}; exit $rc")
    proc = run(["unshare", "-m", "sh", "-c", script], timeout=90)
    assert proc.returncode == 0 and ok_lines(proc, n), proc.stdout
    refused = re.findall(r"rank (\d+)/\d+ refused: checkpoint.save: cannot create .*No space "
                         r"left on device: the 2097152 bytes of data of '.*z\.npy' do not fit",
                         proc.stdout)
    assert sorted(refused) == [str(r) for r in range(n)], proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1] == "ckpt-after", proc.stdout
