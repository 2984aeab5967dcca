"""``spmd.parallel_state`` is ``spmd.layouts.parallel_state``: the same module object, under its short name."""

import sys

from spmd.layouts import parallel_state
from spmd.layouts.parallel_state import *  # noqa: F403 - its names, for type checkers and readers

sys.modules[__name__] = parallel_state
