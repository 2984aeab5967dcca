"""Prints what a plain ``import torch`` did: is the spmd backend registered, is MPI up."""

import json
import sys

import torch.distributed as dist

print(json.dumps({"registered": "SPMD" in dist.Backend._plugins,
                  "mpi4py.MPI": "mpi4py.MPI" in sys.modules,
                  "spmd": "spmd" in sys.modules}))
if len(sys.argv) > 1:
    import spmd.torch  # noqa: F401

    print(json.dumps({"registered": "SPMD" in dist.Backend._plugins}))
