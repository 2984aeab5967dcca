"""``spmd.errors`` is ``spmd.core.errors``: the same module object, under its short name."""

import sys

from spmd.core import errors
from spmd.core.errors import *  # noqa: F403 - its names, for type checkers and readers

sys.modules[__name__] = errors
