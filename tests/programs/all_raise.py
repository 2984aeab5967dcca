"""Every rank raises the same error after a collective (no rank is left waiting), to
check that SPMD_ABORT_ON_EXCEPTION=0 leaves Python's own handling alone.

Each rank's stderr goes to ``<dir>/rank<N>.err``: Python's own traceback printing
writes a line in several pieces, so two ranks sharing the launcher's stream can
interleave inside a line, and the test reads each rank's traceback on its own.
"""
import os
import sys

import numpy as np

import spmd

spmd.init_process_group()
err = os.open(os.path.join(sys.argv[1], f"rank{spmd.get_rank()}.err"),
              os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
sys.stderr.flush()
os.dup2(err, 2)
spmd.all_reduce(np.ones(1))
raise RuntimeError(f"every rank fails: rank {spmd.get_rank()}")
