"""``spmd.coalescing`` is ``spmd.api.coalescing``: the same module object, under its short name."""

import sys

from spmd.api import coalescing
from spmd.api.coalescing import *  # noqa: F403 - its names, for type checkers and readers

sys.modules[__name__] = coalescing
