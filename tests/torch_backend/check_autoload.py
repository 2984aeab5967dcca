"""Prints what a plain ``import torch`` did: is the spmd backend registered, is MPI up,
did it load spmd's runtime (the entry point is in the package, whose import starts
nothing)."""

import json
import sys

import torch.distributed as dist

print(json.dumps({"registered": "SPMD" in dist.Backend._plugins,
                  "mpi4py.MPI": "mpi4py.MPI" in sys.modules,
                  "spmd.runtime": "spmd.runtime" in sys.modules}))
if len(sys.argv) > 1:
    import spmd.torch  # noqa: F401

    print(json.dumps({"registered": "SPMD" in dist.Backend._plugins}))
