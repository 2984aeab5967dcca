"""What the ranks that wait for a late one get, and checks that hold whichever of them
timed out first.

Every waiting rank reaches its deadline at about the same moment.  The first to finish
its diagnosis breaks the group and tells the others (they answer once marked), so a
waiting rank gets either its own diagnosed DistTimeoutError or, told first,
GroupBrokenError "(told by rank N)" naming another waiting rank.  The tests check each
rank's outcome by its kind, and that at least one rank got the diagnosis.
"""

from __future__ import annotations

import re


def check_waiting_rank(dist, outcome, late: int) -> bool:
    """Check one waiting rank's outcome; True if it was its own diagnosed timeout."""
    if isinstance(outcome, dist.DistTimeoutError):
        return True
    assert isinstance(outcome, dist.GroupBrokenError), repr(outcome)
    told = re.search(r"\(told by rank (\d+)\)", str(outcome))
    assert told is not None and int(told.group(1)) != late, str(outcome)
    return False


def some_rank_diagnosed(dist, own: bool) -> None:
    """Every rank calls it: at least one waiting rank got the diagnosis itself."""
    owns = [None] * dist.get_world_size()
    dist.all_gather_object(owns, own)
    assert any(owns), owns
