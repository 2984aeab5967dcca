"""torch's op arguments as the backend reads them: its option objects' timeouts, its
one-tensor lists, its reduce ops (torch's ``ReduceOp`` or an option object holding one)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions

import spmd
from spmd.core.context import GroupContext
from spmd.core.errors import located
from spmd.torch._tensors import reduce_op

__all__ = ["SUM_SPMD", "SUM", "SUM_TORCH", "UNSET_TIMEOUT", "one_tensor", "reduce_of",
           "timeout_of"]

SUM = dist.ReduceOp.SUM
# The SUM of torch's reduce-op enum (what option objects hold) and spmd's, for the hot
# ops' test of their common case.
SUM_TORCH, SUM_SPMD = dist.ReduceOp.RedOpType.SUM, spmd.ReduceOp.SUM  # type: ignore[attr-defined]
UNSET_TIMEOUT = AllreduceOptions().timeout   # c10d's kUnsetTimeout: the group's


def timeout_of(opts) -> float | None:
    """The op's own timeout in seconds, or None for the group's."""
    t = getattr(opts, "timeout", None)
    if isinstance(t, timedelta) and t.total_seconds() > 0:
        return t.total_seconds()
    return None  # kUnsetTimeout (-1 ms): the group's


def one_tensor(tensors, op: str, arg: str, group: GroupContext) -> torch.Tensor:
    """The single tensor of torch's one-element tensor lists (or a bare tensor)."""
    if type(tensors) is list and len(tensors) == 1:   # (what torch passes)
        return tensors[0]
    if isinstance(tensors, torch.Tensor):
        return tensors
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
        got = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise located(ValueError, op, f"{arg} must hold exactly one tensor (one per "
                      f"process), got {got}", group)
    return tensors[0]


def reduce_of(opts, default=SUM) -> spmd.ReduceOp:
    """spmd's reduce op for an op's options (an option object, a bare ReduceOp, None)."""
    if type(opts) is AllreduceOptions:   # torch's all_reduce: the common case first
        return reduce_op(opts.reduceOp)
    if opts is None:
        return reduce_op(default)
    if isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        return reduce_op(opts)
    return reduce_op(opts.reduceOp)
