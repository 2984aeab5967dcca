"""Persistent collectives are found by using them, not by the MPI version number
(spmd.backends.mpi.persistent.persistent_collectives_work)."""

from __future__ import annotations

from mpi4py import MPI

from spmd.backends.mpi import persistent


def test_the_probe_runs_a_persistent_all_reduce_on_this_library():
    # MPICH 4+, Open MPI 5 (which reports MPI 3.1) and Intel MPI 2021 all have them.
    assert persistent.persistent_collectives_work(MPI.COMM_SELF) is True


class _Without:
    """A communicator of a library without MPI_Allreduce_init (mpi4py raises)."""

    def Allreduce_init(self, *args):  # noqa: N802 - mpi4py's name
        raise NotImplementedError("MPI_Allreduce_init")


class _Wrong:
    """A library whose persistent all-reduce returns a wrong sum."""

    class _Req:
        def Start(self):  # noqa: N802
            pass

        def Wait(self):  # noqa: N802
            pass

        def Free(self):  # noqa: N802
            self.freed = True

    def __init__(self):
        self.req = self._Req()

    def Allreduce_init(self, send, recv):  # noqa: N802
        return self.req

    def Get_size(self):  # noqa: N802
        return 1


def test_a_library_without_them_or_with_wrong_results_falls_back():
    assert persistent.persistent_collectives_work(_Without()) is False
    wrong = _Wrong()
    assert persistent.persistent_collectives_work(wrong) is False
    assert wrong.req.freed    # the request is freed whatever the answer


def test_available_asks_the_probe_once_and_honours_the_switch(monkeypatch):
    calls = []
    monkeypatch.setattr(persistent, "_works", None)
    monkeypatch.setattr(persistent, "persistent_collectives_work",
                        lambda comm: calls.append(comm) or False)
    assert persistent.available() is False and persistent.available() is False
    assert calls == [MPI.COMM_SELF]
    monkeypatch.setenv("SPMD_PERSISTENT", "0")
    monkeypatch.setattr(persistent, "_works", True)
    assert persistent.available() is False
