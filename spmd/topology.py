"""``spmd.topology`` is ``spmd.layouts.topology``: the same module object, under its short name."""

import sys

from spmd.layouts import topology
from spmd.layouts.topology import *  # noqa: F403 - its names, for type checkers and readers

sys.modules[__name__] = topology
