"""``spmd.persistent`` is ``spmd.api.persistent``: the same module object, under its short name."""

import sys

from spmd.api import persistent
from spmd.api.persistent import *  # noqa: F403 - its names, for type checkers and readers

sys.modules[__name__] = persistent
