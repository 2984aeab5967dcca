"""torch's ShardedTensor on spmd groups: the device of a rank that holds no shard.

FSDP1's sharded state_dict holds ShardedTensors, chunked over the ranks: a parameter
with fewer rows than there are ranks leaves some rank without a shard (a bias of 4 on
3 ranks).  Asked for its ``.device`` there, ShardedTensor answers CPU when its group's
backend is named "gloo" and the current CUDA device for any other name, which on a
CPU-only machine raises.  An spmd group that moves no CUDA tensors answers CPU as
gloo's does; every other case goes to torch's own answer.
"""

from __future__ import annotations

import torch

__all__ = ["answer_device_without_shards"]

_installed = False


def answer_device_without_shards(cpu_only) -> None:
    """Register the ``.device`` rule for ShardedTensors (once).

    ``cpu_only(group)`` is True for an spmd group that moves no CUDA tensors.
    """
    global _installed
    if _installed:
        return
    # Imported here, when torch makes the first spmd group: the module costs ~10 ms
    # and the backend is loaded on every ``import torch`` (the entry point).
    from torch.distributed._shard.sharded_tensor import custom_sharded_op_impl
    from torch.distributed._shard.sharded_tensor.api import _SHARDED_OPS

    getter = torch.Tensor.device.__get__
    torchs = _SHARDED_OPS[getter]

    @custom_sharded_op_impl(getter)
    def device(types, args=(), kwargs=None, pg=None):
        st = args[0]
        if not st.local_shards() and cpu_only(pg):
            return torch.device("cpu")
        return torchs(types, args, kwargs, pg)

    _installed = True
