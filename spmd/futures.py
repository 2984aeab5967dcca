"""``spmd.futures`` is ``spmd.core.futures``: the same module object, under its short name."""

import sys

from spmd.core import futures
from spmd.core.futures import *  # noqa: F403 - its names, for type checkers and readers

sys.modules[__name__] = futures
