"""``spmd.trace`` is ``spmd.tools.trace``: the same module object, under its short name."""

import sys

from spmd.tools import trace
from spmd.tools.trace import *  # noqa: F403 - its names, for type checkers and readers

sys.modules[__name__] = trace
