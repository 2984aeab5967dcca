"""DeviceMesh in jobs of their own: at 8 ranks the same answers and group identity as
torch's own DeviceMesh (on its fake backend), rank by rank, and layouts no split can
express (the in-job tests: tests/mpi/test_mesh.py)."""

import json
import sys

import pytest
from _launch import mpiexec, run


def _records(stdout):
    rows = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith('{"rank"')]
    return {row["rank"]: row["record"] for row in rows}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_same_answers_as_torch_device_mesh():
    """spmd at 8 ranks against torch's DeviceMesh on its fake backend, rank by rank."""
    pytest.importorskip("torch.distributed", reason="torch is not installed")
    program = "tests/programs/mesh_record.py"
    theirs = run([sys.executable, program, "torch", "8"], timeout=240)
    assert theirs.returncode == 0, theirs.stdout[-3000:]
    ours = run(mpiexec(8, sys.executable, program, "spmd"), timeout=240)
    assert ours.returncode == 0, ours.stdout[-3000:]
    torch_rows, spmd_rows = _records(theirs.stdout), _records(ours.stdout)
    assert sorted(torch_rows) == sorted(spmd_rows) == list(range(8))
    for rank in range(8):
        assert spmd_rows[rank] == torch_rows[rank], f"rank {rank}"


def test_layout_splits_that_no_layout_can_express():
    """Unflattening a flattened (2, 3) of a (2, 2, 3) mesh into (3, 2) would cut the
    size-3 mode unevenly: refused (torch fails an assertion there), while (2, 3) and
    (6, 1) give what torch gives (tests/programs/mesh_record.py checks more at 8 ranks)."""
    from spmd.layouts import mesh_layout as lay

    root = lay.row_major((2, 2, 3))
    flat = lay.collapse([root[0], root[2]])
    assert flat == ((2, 6), (3, 1))
    assert lay.offsets(flat).tolist() == [0, 1, 2, 6, 7, 8]
    with pytest.raises(ValueError, match="cuts a mode of size 3"):
        lay.compose(flat, (3, 2))
    assert lay.compose(flat, (2, 3)) == (((2, 6),), ((3, 1),))
    assert lay.compose(flat, (6, 1)) == (flat, ())
    assert lay.compose(((12, 1),), (2, 3, 2)) == (((2, 6),), ((3, 2),), ((2, 1),))
    assert lay.fits(flat, 12) and not lay.fits(((2, 2), (3, 1)), 12)
    assert [lay.coordinate(i, flat) for i in (0, 2, 6, 8)] == [0, 2, 3, 5]
