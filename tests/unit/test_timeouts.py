"""Timeouts: one conversion (spmd.core.timeouts.to_seconds) and one home for the
defaults, as torch keeps them."""

from __future__ import annotations

import pytest


def test_one_timeout_conversion_and_one_home_for_the_defaults():
    from datetime import timedelta

    from spmd.core.timeouts import (
        DEFAULT_PG_TIMEOUT,
        DEFAULT_STORE_TIMEOUT,
        MAX_SECONDS,
        to_seconds,
    )

    assert DEFAULT_PG_TIMEOUT == timedelta(minutes=30)      # torch's default_pg_timeout
    assert DEFAULT_STORE_TIMEOUT == timedelta(seconds=300)  # torch's Store default
    assert to_seconds(timedelta(milliseconds=1500), "x") == 1.5
    assert to_seconds(2, "x") == 2.0 and to_seconds(0, "x") == 0.0
    assert to_seconds(timedelta(days=10**6), "x") == MAX_SECONDS
    for bad, error in ((-1, ValueError), (float("nan"), ValueError), (True, TypeError),
                       ("1", TypeError), (None, TypeError)):
        with pytest.raises(error, match=r"^new_group: timeout must be a"):
            to_seconds(bad, "new_group")
    with pytest.raises(ValueError, match="must be a positive timedelta"):
        to_seconds(0, "new_group", positive=True)
