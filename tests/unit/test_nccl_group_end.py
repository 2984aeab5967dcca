"""The NCCL communicator follows its group context's one ended state (``on_end``): a
break (a timeout, a peer's notice, a dead member) reaches it as it happens, so no call
polls the context; a destroy or a member's exit alone does not break what it runs, and a
break after either still reaches it.  Tested on the device double's CuPy, without MPI."""

import pytest

from spmd.backends.nccl.communicator import Communicator
from spmd.core.context import GroupContext
from spmd.testing import device_double as dd


class _OneRankComm:
    """What GroupContext asks of its MPI communicator."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1


def _communicator() -> tuple[GroupContext, Communicator]:
    ctx = GroupContext(_OneRankComm(), [0], "end-test", 30.0, "cpu:mpi,cuda:nccl")
    return ctx, Communicator(ctx, dd.cupy, dd.nccl)


def test_a_break_reaches_the_communicator():
    ctx, nc = _communicator()
    assert not nc.group_broken
    ctx.mark_broken("all_reduce #3 timed out", tell_peers=False)
    assert nc.group_broken
    assert nc.broken is None   # NCCL's own states stay its own: nothing was aborted
    assert not nc.held


def test_a_dead_member_breaks_it():
    ctx, nc = _communicator()
    ctx.mark_failed((1,))
    assert nc.group_broken


@pytest.mark.parametrize("first", ["departed", "destroyed"])
def test_a_break_after_another_end_still_reaches_it(first):
    """The context notifies its subscribers once per list; the communicator listens on
    after an end that is not a break."""
    ctx, nc = _communicator()
    if first == "departed":
        ctx.mark_departed("rank 1 exited")
    else:
        ctx.mark_destroyed()
    assert not nc.group_broken
    if first == "departed":
        ctx.break_for_departure()
    else:
        ctx.mark_broken("told by a peer", tell_peers=False)
    assert nc.group_broken


def test_a_communicator_of_a_broken_group_starts_broken():
    ctx = GroupContext(_OneRankComm(), [0], "end-test", 30.0, "cpu:mpi,cuda:nccl")
    ctx.mark_broken("a timeout", tell_peers=False)
    assert Communicator(ctx, dd.cupy, dd.nccl).group_broken
