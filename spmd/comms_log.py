"""``spmd.comms_log`` is ``spmd.tools.comms_log``: the same module object, under its short name."""

import sys

from spmd.tools import comms_log
from spmd.tools.comms_log import *  # noqa: F403 - its names, for type checkers and readers

sys.modules[__name__] = comms_log
