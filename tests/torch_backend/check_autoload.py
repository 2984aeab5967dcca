"""Prints what a plain ``import torch`` did: is the spmd backend registered, is MPI up,
did it load spmd's runtime (the entry point is in the package, whose import starts
nothing), is torch's env:// rendezvous still torch's own; then whether naming another
backend, and then "spmd", changed that."""

import importlib
import json
import sys

import torch.distributed as dist

# The module, not torch.distributed.rendezvous (a function of the same name).
handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers


def env_is_torchs() -> bool:
    return handlers["env"].__module__ == "torch.distributed.rendezvous"


print(json.dumps({"registered": "SPMD" in dist.Backend._plugins,
                  "mpi4py.MPI": "mpi4py.MPI" in sys.modules,
                  "spmd.runtime": "spmd.runtime" in sys.modules,
                  "env:// is torch's": env_is_torchs()}))
if sys.argv[1:] == ["name"]:
    dist.Backend("gloo")
    gloo = env_is_torchs()
    dist.Backend("spmd")
    print(json.dumps({"after gloo": gloo, "after spmd": env_is_torchs(),
                      "name": dist.Backend("SPMD"), "mpi4py.MPI": "mpi4py.MPI" in sys.modules}))
elif len(sys.argv) > 1:
    import spmd.torch  # noqa: F401

    print(json.dumps({"registered": "SPMD" in dist.Backend._plugins}))
