"""Trainers on the spmd torch backend: PyTorch Lightning's DDPStrategy with
``process_group_backend="spmd"`` and Hugging Face Accelerate's multi-CPU mode through
torch's "mpi" name (SPMD_TORCH_MPI=1), each under ``mpiexec`` at 2 and 3 ranks, ending
with the weights the same program gets on gloo under the same launcher.

The weights are float64 and written exactly; at 2 ranks they must be identical to
gloo's, at 3 within 1e-15 (a sum of three gradients may be added in another order,
which moves the last bit).  Every job runs under a wall-clock limit.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from _launch import ROOT, clean_env, mpiexec

pytest.importorskip("torch", reason="torch is not installed")
LIMIT = 180  # seconds for one job (each takes 10-15 s on a loaded 2-core machine)
INSTALL = "pip install -e '.[trainers]'"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(n: int, program: str, args: list[str], out: str, **env: str) -> list[dict]:
    """Run ``program`` at ``n`` ranks; every rank's result, in rank order."""
    os.makedirs(out)
    child = clean_env(GLOO_SOCKET_IFNAME="lo", **env)  # gloo: the loopback only
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "SPMD_TORCH_MPI"):
        if var not in env:
            child.pop(var, None)
    proc = subprocess.run(mpiexec(n, sys.executable, f"tests/programs/{program}", *args, out),
                          cwd=ROOT, env=child, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=LIMIT, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:]
    results = []
    for r in range(n):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            results.append(json.load(f))
    assert [x["rank"] for x in results] == list(range(n)), results
    assert all(x["world"] == n for x in results), [x["world"] for x in results]
    return results


def _same_training(ours: list[dict], gloo: list[dict], atol: float = 1e-15) -> None:
    """Every rank ends with the same weights, changed by training, and gloo's: bit for
    bit at 2 ranks, within ``atol`` at 3 (three gradients may be summed in another
    order)."""
    import torch

    n = len(ours)
    for run in (ours, gloo):
        first = run[0]["weights"]
        assert first != run[0]["initial"], "the weights did not change: nothing was trained"
        for r, x in enumerate(run):
            assert x["weights"] == first, f"rank {r} ended with other weights than rank 0"
    mine, theirs = torch.tensor(ours[0]["weights"]), torch.tensor(gloo[0]["weights"])
    if n == 2:
        assert torch.equal(mine, theirs), (mine - theirs).abs().max()
    else:
        torch.testing.assert_close(mine, theirs, rtol=0, atol=atol)


@pytest.mark.timeout(2 * LIMIT + 30)
@pytest.mark.parametrize("n", [2, 3])
def test_lightning_ddp_strategy_on_spmd_trains_as_gloo(n, tmp_path):
    """Lightning finds the ranks through its MPIEnvironment (mpi4py) and starts DDP with
    the backend named "spmd"; the same program on gloo is the reference."""
    pytest.importorskip("lightning", reason=f"lightning is not installed ({INSTALL})")
    ours = _train(n, "lightning_trainer.py", ["spmd"], str(tmp_path / "spmd"))
    gloo = _train(n, "lightning_trainer.py", ["gloo"], str(tmp_path / "gloo"))
    for x in ours:
        assert (x["mpi_rank"], x["group"], x["backend"]) == (x["rank"], "SpmdProcessGroup", "spmd")
    for x in gloo:
        assert x["backend"] == "gloo", x["backend"]
    _same_training(ours, gloo)


@pytest.mark.timeout(2 * LIMIT + 30)
@pytest.mark.parametrize("n", [2, 3])
def test_accelerate_multi_cpu_on_spmd_as_mpi_trains_as_gloo(n, tmp_path):
    """With SPMD_TORCH_MPI=1, Accelerate's multi-CPU mode picks torch's "mpi" backend,
    which is spmd's (no MASTER_ADDR needed); without it, the same program on gloo."""
    pytest.importorskip("accelerate", reason=f"accelerate is not installed ({INSTALL})")
    ours = _train(n, "accelerate_trainer.py", [], str(tmp_path / "spmd"), SPMD_TORCH_MPI="1")
    gloo = _train(n, "accelerate_trainer.py", [], str(tmp_path / "gloo"),
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    for x in ours:
        assert (x["distributed_type"], x["backend"], x["torch_backend"], x["group"]) == \
            ("DistributedType.MULTI_CPU", "mpi", "mpi", "SpmdProcessGroup"), x
    for x in gloo:
        assert (x["distributed_type"], x["backend"]) == ("DistributedType.MULTI_CPU", "gloo"), x
    _same_training(ours, gloo)


@pytest.mark.slow
@pytest.mark.timeout(2 * LIMIT + 30)
@pytest.mark.parametrize("n", [2, 3])
def test_deepspeed_zero_on_spmd_trains_as_gloo(n, tmp_path):
    """DeepSpeed ZeRO stage 1 and 2 (fp32, a torch optimizer) from
    ``deepspeed.init_distributed(dist_backend="spmd")``, both stages in one job; the same
    program on gloo is the reference: identical weights at 2 ranks, within 1e-7 at 3."""
    pytest.importorskip("deepspeed", reason=f"deepspeed is not installed ({INSTALL})")
    stages = [1, 2]
    listed = ",".join(map(str, stages))
    ours = _train(n, "deepspeed_trainer.py", ["spmd", listed, str(_free_port())],
                  str(tmp_path / "spmd"))
    gloo = _train(n, "deepspeed_trainer.py", ["gloo", listed, str(_free_port())],
                  str(tmp_path / "gloo"))
    for x in ours:
        assert (x["backend"], x["group"]) == ("spmd", "SpmdProcessGroup"), x
    for x in gloo:
        assert x["backend"] == "gloo", x["backend"]
    for i, stage in enumerate(stages):
        for x in ours + gloo:
            assert x["stages"][i]["stage"] == stage, (x["backend"], x["stages"][i]["stage"])
        _same_training([x["stages"][i] for x in ours], [x["stages"][i] for x in gloo],
                       atol=1e-7)   # float32 weights


@pytest.mark.slow
@pytest.mark.timeout(2 * LIMIT + 30)
def test_megatron_core_parallel_state_and_tensor_parallel_layers_on_spmd_as_gloo(tmp_path):
    """Megatron-core at 4 ranks: initialize_model_parallel(TP 2, PP 2) and (EP 2) make
    the same groups on spmd as on gloo, an all_reduce on each gives the same sum, and a
    ColumnParallelLinear + RowParallelLinear pair's forward and backward match the whole
    MLP computed in one process (and gloo's output bit for bit)."""
    pytest.importorskip("megatron.core", reason=f"megatron-core is not installed ({INSTALL})")
    ours = _train(4, "megatron_trainer.py", ["spmd", str(_free_port())], str(tmp_path / "spmd"))
    gloo = _train(4, "megatron_trainer.py", ["gloo", str(_free_port())], str(tmp_path / "gloo"))
    for x, y in zip(ours, gloo):
        assert (x["backend"], x["group"], y["backend"]) == ("spmd", "SpmdProcessGroup", "gloo")
        for layout in ("tp2_pp2", "ep2"):
            assert x[layout] == y[layout], (layout, x[layout], y[layout])
            for name, g in x[layout].items():   # sum of rank + 1 over the group's ranks
                assert g["sum"] == sum(r + 1 for r in g["ranks"]), (layout, name, g)
        assert x["mlp"]["out"] == y["mlp"]["out"]
        assert x["mlp"]["out_error"] <= 1e-12 and max(x["mlp"]["grad_errors"]) <= 1e-12, x["mlp"]
    tp = {tuple(x["tp2_pp2"]["tp"]["ranks"]) for x in ours}
    pp = {tuple(x["tp2_pp2"]["pp"]["ranks"]) for x in ours}
    ep = {tuple(x["ep2"]["ep"]["ranks"]) for x in ours}
    assert tp == {(0, 1), (2, 3)} and pp == {(0, 2), (1, 3)} and ep == {(0, 1), (2, 3)}, (tp, pp, ep)
