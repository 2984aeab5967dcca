"""Shared fixtures, and the kinds of test by folder.

The folder says how a test runs:

* ``unit/``    in one process, no MPI job (logic, tables, stores, signatures);
* ``mpi/``     on every rank of ``mpiexec -n N`` (tests/mpi_pytest.py), once per world size;
* ``engines/`` the same, and again with each engine forced or off (the data path: what
  the engine that takes an op changes);
* ``gpu/``     the same, on GPU arrays (a GPU, or spmd.testing.device_double on CPU);
* ``jobs/``    in one process that starts jobs of its own (mpiexec, srun, spawn, torchrun).

Tests in mpi/, engines/ and gpu/ get the ``mpi`` marker here; every rank runs the same
tests and asserts the same things.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time
from datetime import timedelta

import numpy as np
import pytest

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None


TESTS = pathlib.Path(__file__).resolve().parent
MPI_KINDS = ("mpi", "engines", "gpu")
# The helpers beside this file and the programs tests start import each other by name.
for _path in (str(TESTS), str(TESTS / "programs")):
    if _path not in sys.path:
        sys.path.insert(0, _path)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        kind = pathlib.Path(str(item.path)).resolve().relative_to(TESTS).parts[0]
        if kind in MPI_KINDS:
            item.add_marker(pytest.mark.mpi)
        elif item.get_closest_marker("mpi") is not None:
            raise pytest.UsageError(f"{item.nodeid} is marked mpi but lives in tests/{kind}/: "
                                    f"MPI tests go in tests/{{{','.join(MPI_KINDS)}}}/")
        if item.get_closest_marker("slurm") is not None:
            # The cluster's two nodes and its list of job steps are shared: under
            # pytest-xdist (tests/run.sh, --dist loadgroup) these run on one worker in turn.
            item.add_marker(pytest.mark.xdist_group("slurm"))


# SPMD_TEST_DEVICE=double: the GPU tests run on spmd.testing.device_double (CuPy, CUDA
# streams and events, NCCL, on CPU), so their logic is checked where there is no GPU.
if os.environ.get("SPMD_TEST_DEVICE") == "double":
    from spmd.testing import device_double

    device_double.install()

# Per-test deadline for blocking ops: a rank whose peer failed an assertion raises
# DistTimeoutError here instead of waiting for the group's 30-minute default
# (SPMD_TEST_TIMEOUT: seconds, for the job that checks stall isolation).
TEST_TIMEOUT = timedelta(seconds=float(os.environ.get("SPMD_TEST_TIMEOUT", "60")))


def _initialised():
    import spmd

    if not spmd.is_initialized():
        spmd.init_process_group(timeout=TEST_TIMEOUT)
    return spmd


@pytest.fixture
def dist():
    """spmd, initialised (tests that destroy the default group leave it initialised)."""
    return _initialised()


@pytest.fixture(autouse=True)
def _lockstep(request):
    """Keep ranks in step: every MPI test ends with a barrier, so a test that failed on
    one rank cannot leave its collectives to be matched by the next test's."""
    yield
    if request.node.get_closest_marker("mpi") is None:
        return
    import spmd

    if not spmd.is_initialized():
        return
    world = spmd.GroupMember.WORLD
    if _any_rank(world.context.error is not None):
        # A stall (a rank that never came, an MPI that never completed an op) broke
        # WORLD on some rank once its wait timed out.  A fresh WORLD on every rank keeps
        # the stall in this one test instead of failing every later one on the broken
        # group (or matching its pending collective with the next test's).
        spmd.destroy_process_group()
        spmd.init_process_group(timeout=TEST_TIMEOUT)


_lockstep_comm = None   # the tests' own duplicate of COMM_WORLD: nothing of a test on it


def _any_rank(flag: bool) -> bool:
    """``flag`` OR-ed over the ranks, once every rank has finished its test: on a
    communicator of the tests' own, so a collective a stalled test left pending on WORLD
    is never matched with it; under a deadline, so the suite never hangs here."""
    global _lockstep_comm
    from mpi4py import MPI

    if _lockstep_comm is None:
        _lockstep_comm = MPI.COMM_WORLD.Dup()
    mine, anyone = np.array([int(flag)], np.int64), np.zeros(1, np.int64)
    req = _lockstep_comm.Iallreduce(mine, anyone, op=MPI.MAX)
    deadline = time.monotonic() + 3 * TEST_TIMEOUT.total_seconds()
    while not req.Test():
        if time.monotonic() > deadline:
            raise RuntimeError("the ranks did not all finish this test within 3 test timeouts")
        os.sched_yield()
    return bool(anyone[0])


@pytest.fixture
def fresh(dist):
    """Makes new groups of every rank (``fresh(**new_group_kwargs)``), destroyed after the
    test (broken or not)."""
    made = []

    def make(**kw):
        g = dist.new_group(list(range(dist.get_world_size())), **kw)
        made.append(g)
        return g

    yield make
    for g in made:
        dist.destroy_process_group(g)


@pytest.fixture
def detail(dist):
    """Debug mode DETAIL for groups made inside the test."""
    before = dist.get_debug_level()
    dist.set_debug_level("DETAIL")
    yield
    dist.set_debug_level(before)


@pytest.fixture(scope="module")
def groups():
    """The groups collective tests run on: WORLD, and the even/odd ranks split in two
    (disjoint groups of unequal size at odd world sizes, running concurrently)."""
    dist = _initialised()
    n = dist.get_world_size()
    halves = [list(range(0, n, 2))] + ([list(range(1, n, 2))] if n > 1 else [])
    parity = dist.split_group(split_ranks=halves, group_desc="parity")
    yield {"world": dist.GroupMember.WORLD, "parity": parity}
    if dist.is_initialized():
        dist.destroy_process_group(parity)


def all_dtypes() -> list[np.dtype]:
    dts = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
           np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128]
    out = [np.dtype(d) for d in dts]
    if ml_dtypes is not None:
        out.append(np.dtype(ml_dtypes.bfloat16))
    return out
