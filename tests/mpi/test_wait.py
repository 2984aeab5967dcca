"""The one wait helper: waits outside Work (the shared-memory window set-up, debug mode's
fingerprint exchange) time out into the same diagnosis as a Work, naming the rank that
did not arrive, and leave the group broken."""

from __future__ import annotations

import os
import resource
import time
from datetime import timedelta

import numpy as np
import pytest
from _late_outcomes import check_waiting_rank, some_rank_diagnosed

import spmd
from spmd.runtime import debug

pytestmark = pytest.mark.mpi

TIMEOUT = timedelta(seconds=1.5)


def _straggler_case(dist, make_group, expect_source: str):
    n = dist.get_world_size()
    if n < 2:
        pytest.skip("needs a rank that does not arrive")
    late = n - 1
    pg = make_group()
    own = False
    if dist.get_rank() != late:  # the late rank never reaches the op: it waits in WORLD's
        # barrier below (its control thread answering the diagnosis) until the others
        # have timed out and checked theirs
        with pytest.raises((spmd.DistTimeoutError, spmd.GroupBrokenError)) as info:
            spmd.all_reduce(np.ones(4), group=pg)
        own = check_waiting_rank(dist, info.value, late)
        if own:
            text = str(info.value)
            assert text.startswith("all_reduce: did not complete within"), text
            assert "ranks that have not reached all_reduce #1:" in text, text
            assert f"rank {late}:" in text, text            # the missing rank, named
            assert expect_source in text, text              # which wait it was
            # Broken by this diagnosis, or by another waiting rank's told just before.
            assert "is now broken" in text or "(told by rank" in pg.context.error, text
        with pytest.raises(spmd.GroupBrokenError):
            spmd.all_reduce(np.ones(4), group=pg)
    dist.barrier()  # WORLD is unaffected
    some_rank_diagnosed(dist, own)
    dist.destroy_process_group(pg)


def test_stalled_shared_memory_setup_times_out_with_diagnosis(dist):
    def make():
        saved = os.environ.get("SPMD_SHM")
        os.environ["SPMD_SHM"] = "force"  # the group's host engine takes every op
        try:
            pg = dist.new_group(list(range(dist.get_world_size())), timeout=TIMEOUT,
                                group_desc="stalled-shm")
            pg.engine_for("cpu")  # engine made now, window at its first op
        finally:
            if saved is None:
                del os.environ["SPMD_SHM"]
            else:
                os.environ["SPMD_SHM"] = saved
        return pg

    _straggler_case(dist, make, "setting up the shared-memory engine")


def test_stalled_debug_check_times_out_with_diagnosis(dist):
    def make():
        before = debug.get_debug_level()
        debug.set_debug_level("DETAIL")  # engines made from now on check their calls
        try:
            pg = dist.new_group(list(range(dist.get_world_size())), timeout=TIMEOUT,
                                group_desc="stalled-debug")
            pg.engine_for("cpu")
        finally:
            debug.set_debug_level(before)
        return pg

    _straggler_case(dist, make, "in debug mode")


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "work"])
def test_a_wait_for_a_late_peer_naps_between_polls(dist, blocking):
    """Past NAP_AFTER_SECONDS a waiting rank naps between polls, on the compiled path
    (a blocking op) and in wait_until (a Work's wait): its thread gives its core up
    hundreds of times in a wait of 0.4 s (voluntary context switches: a count that a
    loaded machine does not turn into spinning), where a spinning wait gives it up only
    when the scheduler takes it."""
    from spmd.core import wait

    n = dist.get_world_size()
    if n < 2:
        pytest.skip("needs a peer to wait for")
    if wait.nap_after < 0:
        pytest.skip("SPMD_WAIT=spin: waits never nap")
    late = n - 1
    a = np.full(4, dist.get_rank() + 1.0)
    dist.barrier()
    if dist.get_rank() == late:
        time.sleep(0.4)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
    if blocking:
        dist.all_reduce(a)
    else:
        dist.all_reduce(a, async_op=True).wait()
    switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before
    np.testing.assert_array_equal(a, np.full(4, n * (n + 1) / 2))
    if dist.get_rank() != late:
        # 0.38 s of naps of 20 us (some 70 us with the kernel's timer slack): thousands;
        # a loaded machine lengthens each, but not past a few milliseconds.
        assert switches >= 50, f"rank {dist.get_rank()}: {switches} voluntary switches"
