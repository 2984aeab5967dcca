"""Two MPI tests for tests/jobs/test_stall_isolation.py (run with SPMD_TEST_TIMEOUT=3; not
named test_*, so the suite does not collect them):
the first stalls (the last rank never calls the all_reduce), the second must still run
on a working WORLD."""

import numpy as np
import pytest

pytestmark = pytest.mark.mpi


def test_a_rank_never_comes(dist):
    if dist.get_rank() != dist.get_world_size() - 1:
        # Its own timeout, or told by another waiting rank that timed out first: WORLD
        # is broken after it either way.
        with pytest.raises((dist.DistTimeoutError, dist.GroupBrokenError)):
            dist.all_reduce(np.ones(1))


def test_the_next_test_runs_on_a_working_world(dist):
    x = np.full(3, dist.get_rank() + 1.0)
    dist.all_reduce(x)
    n = dist.get_world_size()
    np.testing.assert_array_equal(x, np.full(3, n * (n + 1) / 2))
