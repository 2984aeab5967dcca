"""``spmd.group`` is ``spmd.runtime.group``: the same module object, under its short name."""

import sys

from spmd.runtime import group
from spmd.runtime.group import *  # noqa: F403 - its names, for type checkers and readers

sys.modules[__name__] = group
