"""Run several of this folder's training scripts one after another in one process.

``mpiexec -n N python tests/torch_backend/run_scripts.py fsdp1_script.py dtensor_script.py``
runs each as ``python SCRIPT`` would (its own ``init_process_group`` and
``destroy_process_group``, its own arguments: none), so that a job pays for importing
torch and starting MPI once instead of once per script: on a 2-core machine importing
torch alone costs each rank about 5 s of CPU.  A script that fails ends the job with
its traceback, as it would on its own.
"""

import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

for name in sys.argv[1:]:
    path = os.path.join(HERE, name)
    sys.argv = [path]
    runpy.run_path(path, run_name="__main__")
    sys.stdout.flush()
