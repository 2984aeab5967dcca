"""Prints (one JSON line) what a plain ``import torch`` made of torch's "mpi" backend
name: is MPI available, what ``Backend("mpi")`` is, whose ``ProcessGroupMPI`` torch
has, the warnings the import gave, and whether it started MPI or loaded spmd's runtime;
with the argument ``init``, then what ``init_process_group("mpi")`` raised."""

import json
import sys
import warnings

with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

theirs = getattr(c10d, "ProcessGroupMPI", None)
print(json.dumps({
    "is_mpi_available": dist.is_mpi_available(),
    "Backend('mpi')": dist.Backend("mpi"),
    "ProcessGroupMPI": None if theirs is None else f"{theirs.__module__}.{theirs.__name__}",
    "warnings": [str(w.message) for w in said if "spmd" in str(w.message)],
    "mpi4py.MPI": "mpi4py.MPI" in sys.modules,
    "spmd.runtime": "spmd.runtime" in sys.modules,
}))
if sys.argv[1:] == ["init"]:
    try:
        dist.init_process_group("mpi")
        print(json.dumps({"raised": None}))
    except Exception as exc:  # noqa: BLE001 - what torch raises is the result
        print(json.dumps({"raised": f"{type(exc).__name__}: {exc}"}))
