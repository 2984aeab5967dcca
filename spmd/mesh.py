"""``spmd.mesh`` is ``spmd.layouts.mesh``: the same module object, under its short name."""

import sys

from spmd.layouts import mesh
from spmd.layouts.mesh import *  # noqa: F403 - its names, for type checkers and readers

sys.modules[__name__] = mesh
