"""Megatron-core's parallel_state and tensor-parallel layers on CPU under
``mpiexec -n 4``, on the "spmd" backend or on gloo (the reference).

    mpiexec -n 4 python tests/programs/megatron_trainer.py spmd|gloo PORT OUTDIR

torch.distributed starts the way Megatron-LM's own scripts start it
(``init_process_group(backend)`` with RANK, WORLD_SIZE, MASTER_ADDR 127.0.0.1 and the
test's PORT from the launcher), then:

- ``initialize_model_parallel(tensor_model_parallel_size=2,
  pipeline_model_parallel_size=2)``: every group parallel_state made (its ranks, and an
  all_reduce of each rank's number + 1 on it);
- a ``ColumnParallelLinear`` + ``RowParallelLinear`` pair on the tensor-parallel group
  (``use_cpu_initialization=True``), forward and backward, checked on every rank against
  the same MLP computed whole in this process from the gathered shards;
- again with ``expert_model_parallel_size=2`` (TP 1, PP 1): the expert groups.

Each rank writes what it saw to OUTDIR/rank<R>.json.  Megatron's helpers that call
torch.cuda (``gather_output``, sequence parallelism, ``model_parallel_cuda_manual_seed``)
are left out: they need a GPU on gloo too.
"""

import sys

import torch
import torch.distributed as dist
from _trainer_io import finish, ranks_from_mpi
from megatron.core import parallel_state as ps
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

GETTERS = {
    "tp": "get_tensor_model_parallel_group", "pp": "get_pipeline_model_parallel_group",
    "dp": "get_data_parallel_group", "cp": "get_context_parallel_group",
    "mp": "get_model_parallel_group", "tp_dp": "get_tensor_and_data_parallel_group",
    "embedding": "get_embedding_group", "position_embedding": "get_position_embedding_group",
    "ep": "get_expert_model_parallel_group", "etp": "get_expert_tensor_parallel_group",
    "edp": "get_expert_data_parallel_group",
}


def groups_seen(rank: int) -> dict:
    """Each group parallel_state holds for this rank: its ranks and an all_reduce on it."""
    seen = {}
    for name, getter in GETTERS.items():
        try:
            g = getattr(ps, getter)()
        except (AssertionError, RuntimeError):   # not made in this layout
            continue
        if g is None:
            continue
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x, group=g)
        seen[name] = {"ranks": dist.get_process_group_ranks(g), "sum": x.item()}
    return seen


def tensor_parallel_mlp(rank: int) -> dict:
    """Column- then row-parallel linear on the tensor-parallel group, forward and
    backward, against the whole MLP computed here from the gathered shards."""
    config = ModelParallelConfig(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                                 use_cpu_initialization=True, params_dtype=torch.float64)
    init = torch.nn.init.xavier_normal_
    torch.manual_seed(7)
    col = ColumnParallelLinear(8, 16, config=config, init_method=init, bias=True,
                               gather_output=False)
    row = RowParallelLinear(16, 4, config=config, init_method=init, bias=True,
                            input_is_parallel=True, skip_bias_add=False)
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    hidden, _ = col(x)
    out, _ = row(torch.tanh(hidden))
    out.sum().backward()
    tp = ps.get_tensor_model_parallel_group()
    size = dist.get_world_size(tp)

    def gathered(t, dim):
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=tp)
        return torch.cat(parts, dim)

    w1, b1 = gathered(col.weight.detach(), 0), gathered(col.bias.detach(), 0)
    w2, b2 = gathered(row.weight.detach(), 1), row.bias.detach()
    ref = [t.clone().requires_grad_(True) for t in (w1, b1, w2, b2)]
    want = torch.tanh(x @ ref[0].T + ref[1]) @ ref[2].T + ref[3]
    want.sum().backward()
    grads = [gathered(col.weight.grad, 0), gathered(col.bias.grad, 0),
             gathered(row.weight.grad, 1), row.bias.grad]
    return {"out_error": (out - want).abs().max().item(),
            "grad_errors": [(g - r.grad).abs().max().item() for g, r in zip(grads, ref)],
            "out": out.flatten().tolist()}


def main() -> None:
    backend, port, outdir = sys.argv[1], sys.argv[2], sys.argv[3]
    ranks_from_mpi(port)
    dist.init_process_group(backend)
    rank = dist.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    result = {"rank": rank, "world": dist.get_world_size(), "backend": dist.get_backend(),
              "group": type(dist.group.WORLD).__name__,
              "tp2_pp2": groups_seen(rank), "mlp": tensor_parallel_mlp(rank)}
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    result["ep2"] = groups_seen(rank)
    ps.destroy_model_parallel()
    finish(outdir, result)


if __name__ == "__main__":
    main()
