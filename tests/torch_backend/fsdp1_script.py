"""FSDP1 (``FullyShardedDataParallel``) training on the spmd backend, checked against
one process.

For every sharding strategy (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD) with
``use_orig_params`` False and True, every rank wraps the same MLP (seed 0, one FSDP unit
per Linear and one at the root) and trains 3 steps on its slice of each batch; the
reference is the unwrapped model trained on the whole batch in this process.  FSDP1
averages the gradients over the ranks, so the full parameters must equal the
reference's after every step.  Then: mixed precision (float32 compute on float64
parameters, matching the reference closely; bfloat16 compute and reduction, equal on
every rank), and the full and the sharded state_dict saved, loaded into a fresh model
(the sharded one through torch.distributed.checkpoint) and equal to the trained one.

FSDP1 frees each unsharded parameter by resizing its storage to 0 after use: this
script is also the check that the backend leaves every tensor resizable.
"""

import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _device_arg import device_from_args
from torch import nn
from torch.distributed.fsdp import (
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

dev = device_from_args()  # cpu, or cuda on a GPU machine (tests/gpu/run.sh)
dist.init_process_group("spmd")
rank, world = dist.get_rank(), dist.get_world_size()
PER_RANK, STEPS = 3, 3


def make_model(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(),
                         nn.Linear(32, 4)).to(dtype).to(dev)


def wrap(model, **kw):
    return FSDP(model, device_id=dev, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), **kw)


def batch(step: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randn(world * PER_RANK, 16, generator=g, dtype=torch.float64)
    y = torch.randn(world * PER_RANK, 4, generator=g, dtype=torch.float64)
    return x.to(dtype).to(dev), y.to(dtype).to(dev)


def train(model, steps=STEPS, dtype=torch.float64, on_step=None):
    """SGD steps of this rank's slice of each batch (the whole batch for the reference)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK) if isinstance(model, FSDP) \
        else slice(None)
    for step in range(steps):
        x, y = batch(step, dtype)
        opt.zero_grad()
        out = model(x[mine])
        nn.functional.mse_loss(out, y[mine].to(out.dtype)).backward()
        opt.step()
        if on_step is not None:
            on_step(step)


def full_params(model) -> dict:
    """{name: full parameter} of an FSDP model (an all-gather of the shards)."""
    with FSDP.summon_full_params(model, writeback=False):
        return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                for n, p in model.named_parameters()}


def assert_matches(model, ref, what, rtol=1e-10, atol=1e-12):
    got = full_params(model)
    initial = make_model().state_dict()
    assert set(got) == set(dict(ref.named_parameters())), (what, sorted(got))
    for name, q in ref.named_parameters():
        torch.testing.assert_close(got[name].to(q.dtype), q.detach(), rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{what} {n}: {m}")
        assert not torch.equal(q.detach(), initial[name]), \
            f"{what}: {name} did not change: the check could not fail"


def same_on_every_rank(params: dict, what: str) -> None:
    for name, p in params.items():
        everyone = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(everyone, p.contiguous())
        for r, q in enumerate(everyone):
            assert torch.equal(q, p), f"{what}: {name} differs between rank {rank} and {r}"


# -- every sharding strategy, with and without the original parameters -------------------
ref = make_model()
ref_steps = []
train(ref, on_step=lambda s: ref_steps.append({n: p.detach().clone()
                                               for n, p in ref.named_parameters()}))
for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP,
                 ShardingStrategy.NO_SHARD):
    for orig in (False, True):
        what = f"{strategy.name} use_orig_params={orig}"
        model = wrap(make_model(), sharding_strategy=strategy, use_orig_params=orig)

        def check(step, model=model, what=what):
            got = full_params(model)
            for name, q in ref_steps[step].items():
                torch.testing.assert_close(got[name], q, rtol=1e-10, atol=1e-12,
                                           msg=lambda m, n=name: f"{what} step {step} {n}: {m}")

        train(model, on_step=check)
        assert_matches(model, ref, what)

# -- mixed precision ----------------------------------------------------------------------
seen = set()
model = wrap(make_model(), mixed_precision=MixedPrecision(
    param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32))
for m in model.modules():
    if isinstance(m, nn.Linear):
        m.register_forward_hook(lambda mod, inp, out: seen.add(out.dtype))
train(model)
assert seen == {torch.float32}, f"mixed precision: the layers computed in {seen}"
assert_matches(model, ref, "mixed precision float32", rtol=1e-5, atol=1e-6)

model = wrap(make_model(), mixed_precision=MixedPrecision(
    param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))
train(model)
bf16 = full_params(model)
same_on_every_rank(bf16, "mixed precision bfloat16")
assert_matches(model, ref, "mixed precision bfloat16", rtol=0.1, atol=0.02)

# -- state_dict: full, then sharded through torch.distributed.checkpoint -----------------
model = wrap(make_model())
train(model)
trained = full_params(model)
with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                          FullStateDictConfig()):
    full = model.state_dict()
assert set(full) == set(trained), sorted(full)
for name, p in trained.items():
    assert torch.equal(full[name].to(dev), p), f"full state_dict: {name}"
fresh = wrap(make_model())
with FSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT,
                          FullStateDictConfig()):
    fresh.load_state_dict(full)
for name, p in full_params(fresh).items():
    assert torch.equal(p, trained[name]), f"full state_dict loaded: {name}"

path = [tempfile.mkdtemp(prefix="spmd-fsdp1-") if rank == 0 else None]
dist.broadcast_object_list(path, src=0)
with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
    dcp.save(model.state_dict(), checkpoint_id=path[0])
fresh = wrap(make_model())
with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
    sharded = fresh.state_dict()
    dcp.load(sharded, checkpoint_id=path[0])
    fresh.load_state_dict(sharded)
for name, p in full_params(fresh).items():
    assert torch.equal(p, trained[name]), f"sharded state_dict loaded: {name}"
dist.barrier()
if rank == 0:
    shutil.rmtree(path[0])

print(f"rank {rank} of {world}: FSDP1 matches single-process training", flush=True)
dist.destroy_process_group()
