"""MPMD links with cupy arrays: send/recv and broadcast between two programs (the even
and odd ranks), through pinned host staging, and handed to MPI directly where MPI is
GPU-aware.  Every rank checks its results against numpy references.  Skips (with the
reason) without CuPy or a GPU, and at one rank (a link needs two programs).

Run on a GPU machine: tests/gpu/run.sh
"""

import numpy as np
import pytest
from _gpu_helpers import cupy, gpu_skip_reason, mpi_mode, to_device, to_host
from mpi4py import MPI

from spmd.backends import gpu_aware_mpi as _aware

pytestmark = pytest.mark.mpi
if gpu_skip_reason() is not None:
    pytest.skip(gpu_skip_reason(), allow_module_level=True)


def _name(rank):
    return "even" if rank % 2 == 0 else "odd"


@pytest.fixture(params=["staging", "direct"])
def link(request, dist):

    cp = cupy()
    if dist.get_world_size() < 2:
        pytest.skip("a link needs two programs, so at least 2 ranks")
    if request.param == "direct":
        found = _aware.decide_gpu_awareness(MPI.Get_library_version(),
                                          _aware.query_cuda_support()[0], {})
        if not found.aware:
            pytest.skip(f"MPI here is not GPU-aware: {found.reason}")
    me = dist.get_rank()
    group = dist.init_program(_name(me))
    with mpi_mode(request.param):  # the link reads the choice at every call
        lk = dist.new_link("odd" if me % 2 == 0 else "even")
        yield cp, lk
        lk.free()
    dist.destroy_process_group(group)


@pytest.mark.parametrize("layout", ["contig", "strided"])
@pytest.mark.parametrize("dt", [np.float32, np.int64, np.float16, np.bool_])
def test_link_send_recv_cupy(dist, link, layout, dt):
    cp, lk = link
    me = dist.get_rank()
    r = lk.rank()
    if r >= lk.remote_size():
        return  # no partner of the same rank in the other program
    sign = 1 if me % 2 == 0 else -1
    host = (np.arange(12).reshape(3, 4) * sign).astype(dt)
    work = lk.isend(to_device(cp, host, layout), dst=r, tag=2)
    out = to_device(cp, np.zeros((3, 4), dt), layout)
    assert lk.recv(out, src=r, tag=2) == r
    work.wait()
    np.testing.assert_array_equal(to_host(out), (np.arange(12).reshape(3, 4) * -sign).astype(dt))


@pytest.mark.parametrize("layout", ["contig", "strided"])
def test_link_broadcast_cupy(dist, link, layout):
    cp, lk = link
    mine = _name(dist.get_rank())
    for src_program in ("even", "odd"):
        sending = mine == src_program
        last = (lk.size() if sending else lk.remote_size()) - 1
        ref = np.arange(10.0).reshape(2, 5) + (100 if src_program == "odd" else 0)
        x = to_device(cp, ref if sending and lk.rank() == last else np.full((2, 5), -1.0),
                      layout)
        lk.broadcast(x, src=last, src_program=src_program)
        if not sending:
            np.testing.assert_array_equal(to_host(x), ref)
        elif lk.rank() != last:
            assert (to_host(x) == -1).all()
