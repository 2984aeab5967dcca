"""Every rank raises the same error after a collective (no rank is left waiting), to
check that SPMD_ABORT_ON_EXCEPTION=0 leaves Python's own handling alone."""
import numpy as np

import spmd

spmd.init_process_group()
spmd.all_reduce(np.ones(1))
raise RuntimeError(f"every rank fails: rank {spmd.get_rank()}")
