"""SPMD_COMMS_LOG and SPMD_TRACE (set by the test) take effect from init_process_group
on, though the program imports the tools only after its collectives."""
import sys

import numpy as np

import spmd

spmd.init_process_group()
for _ in range(3):
    spmd.all_reduce(np.ones(4, np.float64))           # 32 B
spmd.barrier()
assert "spmd.tools.comms_log" in sys.modules and "spmd.tools.trace" in sys.modules
from spmd.tools import comms_log, trace  # noqa: E402  (only now: the point of the test)

stats = comms_log.summary(as_dict=True)
assert stats["all_reduce"][32]["count"] == 3, stats
assert trace.is_tracing()
print(f"rank {spmd.get_rank()} late import OK", flush=True)
spmd.destroy_process_group()
