"""shrink_group without a failure (a planned removal, any MPI): the stayers' group, its
results against numpy, the old group ended; torch's argument checks, alike on every
rank before anything is sent; get_failed_ranks and fault_tolerant on a healthy job.

Shrinking the default group ends every other group and renumbers the ranks, which the
other tests of this process need: that runs in its own job (tests/jobs/
test_shrink_jobs.py); here a copy of WORLD is shrunk.
"""

from datetime import timedelta

import numpy as np
import pytest

pytestmark = pytest.mark.mpi


def _copy_of_world(dist):
    return dist.new_group(list(range(dist.get_world_size())))


@pytest.mark.parametrize("excluded", ["last", "first_and_last"])
def test_the_stayers_get_a_working_group(dist, excluded):
    n, me = dist.get_world_size(), dist.get_rank()
    drop = [n - 1] if excluded == "last" else sorted({0, n - 1})
    if n - len(drop) < 1:
        pytest.skip(f"needs at least {len(drop) + 1} ranks")
    pg = _copy_of_world(dist)
    if me in drop:        # excluded ranks do not call shrink_group (torch's rule)
        dist.barrier()    # ... and wait here until the stayers are done
        dist.destroy_process_group(pg)
        return
    new = dist.shrink_group(drop, pg)
    stay = [r for r in range(n) if r not in drop]
    assert new.ranks == stay and new.size() == len(stay)
    assert new.rank() == stay.index(me)
    x = np.arange(6.0) * (me + 1)
    dist.all_reduce(x, group=new)
    np.testing.assert_array_equal(x, np.arange(6.0) * sum(r + 1 for r in stay))
    out = np.empty(len(stay), np.int64)
    dist.all_gather_into_tensor(out, np.array([me], np.int64), group=new)
    np.testing.assert_array_equal(out, stay)
    with pytest.raises(RuntimeError, match="destroyed"):
        dist.all_reduce(np.zeros(1), group=pg)     # the old group ended
    assert dist.get_failed_ranks(new) == []
    dist.destroy_process_group(new)
    dist.barrier()


def test_a_healthy_job_knows_no_dead_rank(dist):
    assert dist.get_failed_ranks() == []
    assert isinstance(dist.fault_tolerant(), bool)


@pytest.mark.parametrize("args, error, text", [
    (((1,),), TypeError, "ranks_to_exclude must be a list of group ranks, got tuple"),
    (([],), ValueError, "ranks_to_exclude is empty"),
    (([0], None, 7), ValueError, r"shrink_flags must be SHRINK_DEFAULT \(0\) or SHRINK_ABORT "
                                 r"\(1\), got 7"),
    ((["0"],), TypeError, r"ranks_to_exclude\[0\] must be an int, got str"),
    (([99],), ValueError, r"ranks_to_exclude\[0\] = 99 is out of range"),
])
def test_bad_arguments_raise_on_every_rank_before_anything_is_sent(dist, args, error, text):
    if dist.get_world_size() == 1 and "must be a list" not in text and "empty" not in text \
            and "shrink_flags" not in text:   # torch checks the size before the elements
        error, text = ValueError, "cannot shrink a group of size 1"
    pg = _copy_of_world(dist)
    with pytest.raises(error, match=text) as info:
        dist.shrink_group(*args[:1], pg, *args[2:])
    assert f"[rank {dist.get_rank()}, group " in str(info.value)
    dist.destroy_process_group(pg)


def test_excluding_oneself_or_everyone_is_refused(dist):
    n, me = dist.get_world_size(), dist.get_rank()
    pg = _copy_of_world(dist)
    if n == 1:
        with pytest.raises(ValueError, match="cannot shrink a group of size 1"):
            dist.shrink_group([0], pg)
    else:
        with pytest.raises(ValueError, match=f"cannot exclude all {n} ranks"):
            dist.shrink_group(list(range(n)), pg)
        with pytest.raises(RuntimeError, match=f"this rank \\({me}\\) is in ranks_to_exclude"):
            dist.shrink_group([me], pg)
        with pytest.raises(ValueError, match="is listed twice"):
            dist.shrink_group([(me + 1) % n, (me + 1) % n], pg)
    dist.destroy_process_group(pg)


def test_a_group_broken_by_a_timeout_says_what_mpi_would_go_on(dist):
    """Without ULFM (this suite's jobs do not run under --with-ft ulfm) nothing shows
    whether the rank that never came is dead: shrink_group says so, and what MPI can."""
    n, me = dist.get_world_size(), dist.get_rank()
    if n == 1:
        pytest.skip("needs a rank that does not come")
    pg = dist.new_group(list(range(n)), timeout=timedelta(seconds=1))
    if me != n - 1:   # the last rank never enters the all_reduce
        # Its own timeout, or told by another waiting rank that timed out first.
        with pytest.raises((dist.DistTimeoutError, dist.GroupBrokenError)):
            dist.all_reduce(np.ones(1), group=pg)
        with pytest.raises(RuntimeError, match=r"is broken since .*needs an MPI with ULFM: "
                                               r".*mpiexec --with-ft ulfm") as info:
            dist.shrink_group([n - 1], pg)
        assert f"[rank {me}, group " in str(info.value)
    dist.barrier()   # WORLD is fine
