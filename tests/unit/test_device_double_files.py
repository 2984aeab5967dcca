"""The device double's NCCL communicators exchange data through files; they must not
outlive the communicator.  The last member to leave removes the directory, whether it
left by ``destroy``, by ``abort`` or by its process ending.  Each member here is its own
Python process, as a rank is."""

import os
import subprocess
import sys

import pytest

_MEMBER = r"""
import sys
from spmd.testing import device_double as dd
dd.install()
uid, rank, n, how = bytes.fromhex(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
comm = dd.nccl.NcclCommunicator(n, uid, rank)
x = dd.cupy.arange(4, dtype=dd.cupy.float32) + rank
comm.allReduce(x.data.ptr, x.data.ptr, 4, dd.nccl.NCCL_FLOAT32, dd.nccl.NCCL_SUM,
               dd.cupy.cuda.get_current_stream().ptr)
print(dd.cupy.asnumpy(x).tolist(), flush=True)
if how == "destroy":
    comm.destroy()
elif how == "abort":
    comm.abort()
# "exit": the process ends with the communicator open
"""


def _run_members(tmp_path, hows: list[str]) -> tuple[str, list[str]]:
    uid = os.urandom(128)
    env = dict(os.environ, SPMD_DEVICE_DOUBLE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", _MEMBER, uid.hex(), str(r), str(len(hows)), how],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, how in enumerate(hows)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        outs.append(out.strip())
    return f"spmd-nccl-double-{uid[:12].hex()}", outs


@pytest.mark.parametrize("hows", [["destroy", "destroy"], ["exit", "exit"], ["abort", "exit"],
                                  ["destroy", "exit", "abort"]])
def test_the_last_member_out_removes_the_files(tmp_path, hows):
    name, outs = _run_members(tmp_path, hows)
    n = len(hows)
    expected = [float(sum(i + r for r in range(n))) for i in range(4)]
    assert outs == [str(expected)] * n          # the data went through the files
    assert os.listdir(tmp_path) == [], f"left behind: {os.listdir(tmp_path)} ({name})"


def test_a_member_that_never_came_leaves_them(tmp_path):
    """Nobody can tell the missing member's files from a slow one's: they stay, which is
    why a test run points SPMD_DEVICE_DOUBLE_DIR at a directory it removes."""
    uid = os.urandom(128)
    env = dict(os.environ, SPMD_DEVICE_DOUBLE_DIR=str(tmp_path))
    code = ("import sys\nfrom spmd.testing import device_double as dd\ndd.install()\n"
            "comm = dd.nccl.NcclCommunicator(2, bytes.fromhex(sys.argv[1]), 0)\ncomm.abort()\n")
    subprocess.run([sys.executable, "-c", code, uid.hex()], env=env, check=True, timeout=60)
    assert os.listdir(tmp_path) == [f"spmd-nccl-double-{uid[:12].hex()}"]
    assert os.listdir(tmp_path / os.listdir(tmp_path)[0]) == ["bye.r0"]
