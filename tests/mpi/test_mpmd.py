"""MPMD: programs in one job, the program table, and links between programs.

Under one ``mpiexec -n N pytest`` the "programs" are the even and odd ranks (named so);
real two-program jobs run from plain tests: two different scripts in one mpiexec
(tests/programs/mpmd_left.py : mpmd_right.py), the ocean/atmosphere example and debug
mode over a link (tests/programs/mpmd_debug.py).  GPU arrays on links: the choice
between device pointer and host staging is tested here with numpy arrays through the
same code (a host stand-in for the CUDA copies); tests/gpu/test_gpu_mpmd.py runs cupy."""


import numpy as np
import pytest

from spmd.backends import gpu_aware_mpi as _aware
from spmd.backends.mpi import job as mpi_job
from spmd.backends.mpi import link as link_module
from spmd.layouts import mpmd


def _name(rank):
    return "even" if rank % 2 == 0 else "odd"


@pytest.fixture
def programs(dist):
    group = dist.init_program(_name(dist.get_rank()))
    yield group
    dist.destroy_process_group(group)


def _two_programs(dist):
    if dist.get_world_size() < 2:
        pytest.skip("a link needs two programs, so at least 2 ranks")


@pytest.mark.mpi
def test_program_group_and_table(dist, programs):
    me, n = dist.get_rank(), dist.get_world_size()
    mine = list(range(me % 2, n, 2))
    assert programs.ranks == mine and programs.rank() == mine.index(me)
    x = np.array([me], np.int64)
    dist.all_reduce(x, group=programs)
    assert x[0] == sum(mine)
    table = dist.get_programs()
    assert [(p.name, p.index, list(p.ranks), p.size) for p in table] == \
        [("even", 0, list(range(0, n, 2)), len(range(0, n, 2)))] + \
        ([("odd", 1, list(range(1, n, 2)), len(range(1, n, 2)))] if n > 1 else [])
    assert mpmd.get_program() == table[me % 2]
    assert mpmd.get_program("even") == table[0]
    with pytest.raises(ValueError, match=r"no program named 'ocean'; the programs are \['even'"):
        mpmd.get_program("ocean")


@pytest.mark.mpi
def test_appnum_names_the_program(dist):
    appnum = mpi_job.app_number()
    if appnum is None:
        pytest.skip("this launcher does not set MPI_APPNUM")
    group = dist.init_program()
    assert mpmd.get_program().name == f"app{appnum}" and group.size() == dist.get_world_size()
    dist.destroy_process_group(group)


@pytest.mark.mpi
def test_no_name_and_no_appnum_fails_everywhere(dist, monkeypatch):
    monkeypatch.setattr(mpi_job, "app_number", lambda: None)
    me = dist.get_rank()
    with pytest.raises(ValueError, match=r"ranks \[0\] passed no program name and the launcher "
                                         r"did not set MPI_APPNUM"):
        dist.init_program(None if me == 0 else "named")


@pytest.mark.mpi
def test_names_and_appnums_must_agree(dist, monkeypatch):
    _two_programs(dist)
    me = dist.get_rank()
    monkeypatch.setattr(mpi_job, "app_number", lambda: me % 2)
    with pytest.raises(ValueError, match="program name 'same' is used by the programs started "
                                         "as MPI_APPNUM 0 and 1"):
        dist.init_program("same")
    monkeypatch.setattr(mpi_job, "app_number", lambda: 0)  # one launched script, two roles: fine
    group = dist.init_program(_name(me))
    assert [p.name for p in dist.get_programs()] == ["even", "odd"]
    dist.destroy_process_group(group)
    with pytest.raises(TypeError, match="name must be a non-empty str or None, got ''"):
        dist.init_program("")


@pytest.mark.mpi
def test_link_arrays(dist, programs):
    _two_programs(dist)
    me = dist.get_rank()
    other = "odd" if me % 2 == 0 else "even"
    link = dist.new_link(other)
    r, remote = link.rank(), link.remote_size()
    assert link.remote.name == other and link.local.name == _name(me)
    # rank r of each program exchanges with rank r of the other, where both exist
    for dt in (np.float64, np.int32, np.bool_, np.float16, np.complex64):
        if r >= remote:
            continue
        work = link.isend(np.full(3, r + 1).astype(dt), dst=r, tag=5)
        got = np.zeros(3, dt)
        assert link.recv(got, src=r, tag=5) == r
        assert (got == np.full(3, r + 1).astype(dt)).all(), dt
        work.wait()
    # a non-contiguous receive buffer is filled in place
    if r == 0:
        scale = 1.0 if me % 2 == 0 else 2.0
        work = link.isend(np.arange(6.0) * scale, dst=0)
        box = np.zeros((6, 2))
        assert link.recv(box[:, 1], src=0) == 0
        assert (box[:, 1] == np.arange(6.0) * (3.0 - scale)).all() and (box[:, 0] == 0).all()
        work.wait()
    link.free()


@pytest.mark.mpi
def test_link_receive_any_source(dist, programs):
    _two_programs(dist)
    me = dist.get_rank()
    link = dist.new_link("odd" if me % 2 == 0 else "even")
    # rank 0 of "odd" sends to rank 0 of "even" with no source given on the receiver
    if me == 1:
        link.send(np.array([7.0]), dst=0, tag=3)
    elif me == 0:
        got = np.zeros(1)
        work = link.irecv(got, tag=3)
        work.wait()
        assert work.source_rank() == 0 and got[0] == 7.0
    link.free()


@pytest.mark.mpi
def test_link_broadcast_and_objects(dist, programs):
    _two_programs(dist)
    me = dist.get_rank()
    mine = _name(me)
    link = dist.new_link("odd" if mine == "even" else "even")
    last_odd = link.remote_size() - 1 if mine == "even" else link.size() - 1
    for src_program, src in (("even", 0), ("odd", last_odd)):
        x = np.full((2, 3), -1.0)
        if mine == src_program and link.rank() == src:
            x[:] = np.arange(6.0).reshape(2, 3)
        link.broadcast(x, src=src, src_program=src_program)
        if mine != src_program:
            assert (x == np.arange(6.0).reshape(2, 3)).all()
        elif link.rank() != src:
            assert (x == -1).all()  # the sending program's other ranks are untouched
        obj = {"from": src_program, "n": [1, 2, 3]} if mine == src_program else None
        got = link.broadcast_object(obj, src=src, src_program=src_program)
        assert got == ({"from": src_program, "n": [1, 2, 3]} if mine != src_program else obj)
    # objects point to point: rank 0 of each program sends to rank 0 of the other
    if link.rank() == 0:
        link.send_object(("hello", mine, np.arange(3)), dst=0)
        word, sender, arr = link.recv_object(src=0)
        assert word == "hello" and sender != mine and (arr == np.arange(3)).all()
    link.free()


@pytest.mark.mpi
def test_link_errors(dist, programs):
    me = dist.get_rank()
    mine = _name(me)
    with pytest.raises(ValueError, match=f"peer '{mine}' is this rank's own program"):
        dist.new_link(mine)
    with pytest.raises(ValueError, match="no program named 'ocean'"):
        dist.new_link("ocean")
    _two_programs(dist)
    link = dist.new_link("odd" if mine == "even" else "even")
    remote = link.remote_size()
    with pytest.raises(ValueError, match=rf"Link.isend: dst={remote} is out of range \[0, "
                                         rf"{remote}\) \(the ranks of program"):
        link.isend(np.zeros(1), dst=remote)
    with pytest.raises(TypeError, match="Link.send: tensor must be a numpy array"):
        link.send([1.0], dst=0)
    with pytest.raises(ValueError, match="src_program must be 'even' or 'odd', got 'ocean'"):
        link.broadcast(np.zeros(1), src=0, src_program="ocean")
    with pytest.raises(ValueError, match="src must be a rank of program"):
        link.broadcast(np.zeros(1), src=99, src_program="even")
    link.free()
    with pytest.raises(RuntimeError, match="was freed"):
        link.send(np.zeros(1), dst=0)


@pytest.mark.mpi
def test_link_debug_mode_mismatch_raises_on_both_programs(dist, programs, detail):
    _two_programs(dist)
    me, n = dist.get_rank(), dist.get_world_size()
    mine = _name(me)
    link = dist.new_link("odd" if mine == "even" else "even")
    cases = [  # (this rank's call, the field the error names)
        (lambda: link.broadcast(np.zeros(4 if me == n - 1 else 3), 0, "even"), "shape"),
        (lambda: link.broadcast(np.zeros(3), 0, "even") if mine == "even"
         else link.broadcast_object(None, 0, "even"), "op"),
        (lambda: link.broadcast_object(None, 0, mine), "src_program"),
    ]
    for call, field in cases:
        with pytest.raises(dist.CollectiveMismatchError) as info:
            call()
        text = str(info.value)
        assert "ranks of link link:" in text and f"different arguments: {field}: " in text, text
        # the link is still in step
        got = link.broadcast_object(me if me == 0 else None, 0, "even")
        assert got == (None if mine == "even" and me != 0 else 0)
    x = np.arange(3.0) if mine == "even" else np.zeros(3)  # matched: passes, delivers
    link.broadcast(x, 0, "even")
    assert (x == np.arange(3.0)).all()
    link.free()


# -- GPU arrays on links: the path, with numpy through the same code -------------------

A = _aware.GpuAwareness


class HostStaging:
    """The CUDA copies of spmd.backends.staging.Staging, on host arrays, counted."""

    def __init__(self):
        self.calls = []

    def sync(self):
        self.calls.append("sync")

    def down(self, a):
        self.calls.append("down")
        return np.ascontiguousarray(a).copy()

    def host_buffer(self, a):
        self.calls.append("host_buffer")
        return np.empty(a.shape, a.dtype)

    def up(self, a, h):
        self.calls.append("up")
        np.copyto(a, h)


@pytest.mark.mpi
@pytest.mark.parametrize("aware, nonblocking", [(True, True), (True, False), (False, False)])
def test_link_gpu_arrays_host_side(dist, programs, monkeypatch, aware, nonblocking):
    """Link send/recv/broadcast of "device" arrays (numpy here) take the device pointer
    or host staging as the injected GPU awareness says, and deliver the same data."""
    _two_programs(dist)
    me = dist.get_rank()
    mine = _name(me)
    link = dist.new_link("odd" if mine == "even" else "even")
    stager = HostStaging()
    link._staging = stager
    monkeypatch.setattr(link_module, "is_device_array", lambda a: True)
    monkeypatch.setattr(link_module._aware, "mpi_gpu_support",
                        lambda: A(aware, "injected", nonblocking))
    r = link.rank()
    staged_p2p = not aware
    if r < link.remote_size():  # send/recv pairs: rank r of each program
        for layout in ("contig", "strided"):
            wide = np.zeros((3, 8))  # strided: every other column of it
            sent = wide[:, ::2] if layout == "strided" else np.zeros((3, 4))
            sent[...] = np.arange(12.0).reshape(3, 4) * (1 if mine == "even" else -1)
            stager.calls.clear()
            work = link.isend(sent, dst=r, tag=4)
            out = np.zeros((3, 8))[:, ::2] if layout == "strided" else np.zeros((3, 4))
            assert link.recv(out, src=r, tag=4) == r
            work.wait()
            expect = np.arange(12.0).reshape(3, 4) * (-1 if mine == "even" else 1)
            np.testing.assert_array_equal(out, expect)
            staged = staged_p2p or layout == "strided"
            assert stager.calls == (["down", "host_buffer", "up"] if staged
                                    else ["sync", "sync"]), (layout, stager.calls)
    stager.calls.clear()
    x = np.arange(5.0) if (mine == "even" and r == 0) else np.full(5, -1.0)
    link.broadcast(x, src=0, src_program="even")
    if mine == "odd":
        np.testing.assert_array_equal(x, np.arange(5.0))
        # receivers relay through an Ibcast: a collective
        assert stager.calls == (["sync"] if aware and nonblocking else ["host_buffer", "up"])
    elif r == 0:
        assert stager.calls == (["sync"] if aware else ["down"])
    else:
        assert stager.calls == [] and (x == -1).all()
    link.free()


@pytest.mark.mpi
def test_functions_need_init_program(dist):
    dist.destroy_process_group()
    from conftest import TEST_TIMEOUT

    dist.init_process_group(timeout=TEST_TIMEOUT)
    with pytest.raises(RuntimeError, match="call spmd.layouts.mpmd.init_program"):
        dist.get_programs()


