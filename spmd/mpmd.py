"""``spmd.mpmd`` is ``spmd.layouts.mpmd``: the same module object, under its short name."""

import sys

from spmd.layouts import mpmd
from spmd.layouts.mpmd import *  # noqa: F403 - its names, for type checkers and readers

sys.modules[__name__] = mpmd
