"""A known sequence of ops under SPMD_TRACE and SPMD_COMMS_LOG (set by the test)."""
import numpy as np

import spmd

spmd.init_process_group()
n = spmd.get_world_size()
assert spmd.comms_log.is_enabled() and spmd.trace.is_tracing()
for _ in range(4):
    spmd.all_reduce(np.ones(6, np.float32))          # 24 B
spmd.broadcast(np.zeros(3, np.int64), src=0)          # 24 B
spmd.barrier()
stats = spmd.comms_log.summary(as_dict=True)
assert stats["all_reduce"][24]["count"] == 4, stats
assert stats["broadcast"][24]["count"] == 1, stats
spmd.comms_log.summary()
print(f"rank {spmd.get_rank()} observe OK", flush=True)
spmd.destroy_process_group()
