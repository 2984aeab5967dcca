"""``spmd bench`` end to end (its own MPI jobs): the JSON has every field, the table
and plot come out; and the environment switches of the comms logger and traces.
Correctness and output shape only: nothing here asserts a timing."""

import glob
import importlib.util
import json
import os
import sys

import pytest
from _launch import mpiexec, run

QUICK = ["--quick", "--no-progress"]
ONE_RANK = ["--one-rank"]   # what a world of one process needs to be measured at all
ROW_FIELDS = {"op", "bytes", "count", "impl", "iters", "median_us", "p10_us", "p90_us",
              "mean_us", "min_us", "algbw_gbps", "busbw_gbps", "vs_mpi4py"}


def _bench(n, *args, timeout=240):
    return run(mpiexec(n, sys.executable, "-m", "spmd.tools.bench", *args), timeout=timeout)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [1, 3])
def test_quick_json_has_every_field(n, tmp_path):
    out = tmp_path / "bench.json"
    proc = _bench(n, *QUICK, *(ONE_RANK if n == 1 else []),
                  "--impls", "spmd,mpi4py,spmd-persistent", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:]
    doc = json.loads(out.read_text())
    assert doc["format"] == "spmd-bench" and doc["environment"]["world_size"] == n
    assert doc["environment"]["torch"] is None
    ops = {"all_reduce", "broadcast", "reduce", "all_gather_into_tensor",
           "reduce_scatter_tensor", "all_to_all_single", "barrier"}
    if n > 1:   # a ping-pong has no peer at one rank
        ops.add("send_recv")
    assert {r["op"] for r in doc["results"]} == ops
    sizes = sorted({r["bytes"] for r in doc["results"] if r["op"] == "all_reduce"})
    assert sizes == [8, 64, 512, 4096, 32768]
    for r in doc["results"]:
        assert ROW_FIELDS <= set(r), r
        assert r["p10_us"] <= r["median_us"] <= r["p90_us"]
        assert r["iters"] >= 3
        if r["impl"] == "mpi4py":
            assert r["vs_mpi4py"] == 1.0
    for op in ops - {"send_recv"}:
        impls = {r["impl"] for r in doc["results"] if r["op"] == op}
        assert impls == {"spmd", "mpi4py", "spmd-persistent"}, op
    # sizes a group of n splits evenly: the gathered/scattered array holds n pieces
    for r in doc["results"]:
        if r["op"] in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
            assert r["count"] % n == 0
    fusion = {r["impl"]: r for r in doc["fusion"]}
    assert set(fusion) == {"spmd all_reduce x N", "mpi4py Allreduce x N",
                           "spmd all_reduce_coalesced", "spmd coalescing_manager",
                           "spmd persistent all_reduce_coalesced"}
    assert fusion["spmd all_reduce x N"]["speedup_vs_separate"] == 1.0
    assert "== all_reduce" in proc.stdout
    if n == 1:   # the targets' bounds are about ranks talking: none at one rank
        assert doc["targets"] == [] and "== targets" not in proc.stdout
        assert "MISS" not in proc.stdout and "met " not in proc.stdout
        assert "one rank (--one-rank): no message leaves the process" in proc.stdout
        return
    names = {t["name"].split(":")[0] for t in doc["targets"]}
    assert {"latency", "fusion"} <= names
    for t in doc["targets"]:
        assert set(t) == {"name", "op", "bytes", "measured", "measured_p10", "bound", "met"}
    # the table goes to stdout next to --json FILE
    assert "== all_reduce" in proc.stdout and "== targets" in proc.stdout


@pytest.mark.timeout(300)
def test_json_to_stdout_table_and_plot(tmp_path):
    plot = tmp_path / "bench.png"
    have_mpl = importlib.util.find_spec("matplotlib") is not None
    args = [*QUICK, "--ops", "all_reduce,barrier", "--impls", "spmd,mpi4py",
            "--max-bytes", "64", "--fusion-arrays", "0", "--json"]
    if have_mpl:
        args += ["--plot", str(plot)]
    proc = run(mpiexec(2, sys.executable, "-m", "spmd", "bench", *args), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:]
    doc = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert {(r["op"], r["bytes"]) for r in doc["results"]} == {("all_reduce", 8),
                                                               ("all_reduce", 64),
                                                               ("barrier", 0)}
    assert doc["fusion"] == []
    if have_mpl:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_gloo_in_the_same_job(tmp_path):
    pytest.importorskip("torch.distributed")
    out = tmp_path / "bench.json"
    proc = _bench(2, *QUICK, "--ops", "all_reduce,send_recv", "--max-bytes", "64",
                  "--impls", "spmd,mpi4py,torch-gloo,torch-spmd",
                  "--fusion-arrays", "0", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:]
    doc = json.loads(out.read_text())
    assert doc["environment"]["torch"]
    impls = {(r["op"], r["impl"]) for r in doc["results"]}
    assert ("all_reduce", "torch-gloo") in impls and ("send_recv", "torch-gloo") in impls
    spmd_rows = [r for r in doc["results"] if r["impl"] == "spmd"]
    assert all(r["torch_over_spmd"] > 0 for r in spmd_rows)
    assert any(t["name"].startswith("speed-up over torch") for t in doc["targets"])
    backend = {(t["op"], t["name"]) for t in doc["targets"] if t["name"].startswith("torch backend")}
    assert backend == {("all_reduce", "torch backend: torch-gloo / torch-spmd time, smallest size"),
                       ("all_reduce", "torch backend: torch-gloo / torch-spmd time (worst size)"),
                       ("send_recv", "torch backend: torch-gloo / torch-spmd time (worst size)")}


def test_bad_arguments():
    from spmd.tools import bench

    assert bench.parse_size("8") == 8
    assert bench.parse_size("64K") == 65536
    assert bench.parse_size("1MiB") == 1024**2
    assert bench.parse_size("2 GB") == 2 * 1024**3
    with pytest.raises(Exception, match="not a size"):
        bench.parse_size("lots")
    proc = _bench(1, *ONE_RANK, "--ops", "all_reduce,nope", timeout=120)
    assert proc.returncode != 0 and "unknown op 'nope'" in proc.stdout


@pytest.mark.timeout(200)
def test_env_switches_take_effect_though_the_program_imports_the_tools_late(tmp_path):
    """The settings act from init_process_group on, whatever the program imports: the
    collectives before its first use of spmd.tools are logged and traced."""
    pattern = str(tmp_path / "late-%r.json")
    proc = run(mpiexec(2, sys.executable, "tests/programs/settings_late_import.py"),
               timeout=120, SPMD_TRACE=pattern, SPMD_COMMS_LOG="1")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "rank 0 late import OK" in proc.stdout and "rank 1 late import OK" in proc.stdout
    files = sorted(os.path.basename(f) for f in glob.glob(str(tmp_path / "late-*.json")))
    assert files == ["late-0.json", "late-1.json"], files
    events = json.loads((tmp_path / "late-0.json").read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("name") == "all_reduce") == 3, events


def test_env_switches_trace_and_comms_log(tmp_path):
    pattern = str(tmp_path / "tr-%r.json")
    proc = run(mpiexec(2, sys.executable, "tests/programs/observe_env.py"), timeout=120,
               SPMD_TRACE=pattern, SPMD_COMMS_LOG="1")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "rank 0 observe OK" in proc.stdout and "rank 1 observe OK" in proc.stdout
    assert "spmd comms log: 2 rank(s)" in proc.stdout
    files = sorted(glob.glob(str(tmp_path / "tr-*.json")))
    assert [os.path.basename(f) for f in files] == ["tr-0.json", "tr-1.json"]
    merged = tmp_path / "job.json"
    m = run([sys.executable, "-m", "spmd", "trace-merge", "-o", str(merged), *files],
            timeout=60)
    assert m.returncode == 0, m.stdout
    doc = json.loads(merged.read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        mine = [e["name"] for e in xs if e["pid"] == rank
                and e["name"] in ("all_reduce", "broadcast", "barrier")]
        assert mine == ["all_reduce"] * 4 + ["broadcast", "barrier"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [1, 2])
def test_gpu_bench_on_the_device_double(n):
    """The GPU bench's table and target lines (its figures are the double's, not a GPU's);
    what needs torch with CUDA is listed as not run, with the reason."""
    proc = _bench(n, "--device", "double", "--quick", *(ONE_RANK if n == 1 else []))
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    assert f"GPU all_reduce (float32), {n} rank(s)" in out and "spmd device double" in out, out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.startswith(("spmd-cupy ", "cupy-nccl "))}
    assert set(rows) == {"spmd-cupy", "cupy-nccl"}, out
    assert all(len(v) == 5 and all(float(x) > 0 for x in v) for v in rows.values()), out
    assert "not run: torch-nccl (" in out, out
    if n == 1:   # --one-rank: the figures, no target lines
        assert "target:" not in out, out
        return
    assert "target: 8 B host cost per call, spmd-cupy - cupy-nccl = " in out, out
    assert out.count("target: 8 B back-to-back time per call") == 3, out
    assert "spmd-cupy / torch-nccl: not measured (torch-nccl:" in out
    assert len([line for line in out.splitlines()
                if line.startswith("target:") and "spmd-cupy / cupy-nccl = " in line]) == 2, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_mode_table_and_json(tmp_path):
    """``spmd bench --torch``: every op of the torch mode on spmd, gloo, the do-nothing
    backend and mpi4py in one job, ratios beside the times, the target and the floor."""
    pytest.importorskip("torch.distributed")
    from spmd.tools.bench_torch import TORCH_IMPLS, TORCH_OPS

    out = tmp_path / "torch.json"
    proc = _bench(2, "--torch", *QUICK, "--min-bytes", "16", "--max-bytes", "1K",
                  "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:]
    doc = json.loads(out.read_text())
    assert doc["format"] == "spmd-bench-torch" and doc["world_size"] == 2
    assert [r["op"] for r in doc["results"]] == \
        [op for op in TORCH_OPS for _ in ([0] if op == "barrier" else [16, 128, 1024])]
    for r in doc["results"]:
        assert set(r["median_us"]) == set(TORCH_IMPLS), r
        assert all(t > 0 for t in r["median_us"].values()), r
        assert r["vs_mpi4py"]["mpi4py"] == 1.0
    t = doc["target"]
    assert (t["op"], t["bytes"], t["bound"]) == ("all_reduce", 16, 2.0)
    assert t["met"] == (t["measured"] <= 2.0)
    for op in TORCH_OPS:
        assert f"== {op}" in proc.stdout
    assert "target: all_reduce 16 B, torch-spmd / mpi4py = " in proc.stdout
    assert "floor: torch's dispatch of all_reduce into a Python ProcessGroup" in proc.stdout


def test_torch_mode_refuses_unknown_names():
    pytest.importorskip("torch.distributed")
    proc = _bench(1, "--torch", *ONE_RANK, "--quick", "--ops", "all_reduce,all_to_all_single",
                  timeout=120)
    assert proc.returncode != 0
    assert "unknown op 'all_to_all_single'; expected some of all_reduce," in proc.stdout


@pytest.mark.timeout(200)
@pytest.mark.parametrize("launch", ["python", "mpiexec -n 1"])
def test_one_process_is_told_how_to_start_it(launch):
    """In a world of one process the bench measures nothing: it says how to start it,
    and exits with status 2 before a single call is timed."""
    cmd = [sys.executable, "-m", "spmd", "bench", "--quick", "--no-progress"]
    proc = run(cmd if launch == "python" else mpiexec(1, *cmd), timeout=120)
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert "spmd bench measures communication between ranks, and this is a world of one " \
           "process." in proc.stdout
    assert "mpiexec -n 2 spmd bench" in proc.stdout and "--one-rank" in proc.stdout
    assert "==" not in proc.stdout and "MISS" not in proc.stdout, proc.stdout


@pytest.mark.timeout(200)
def test_one_rank_on_request_has_no_targets():
    """``--one-rank``: the per-call host cost of a world of one, without send_recv (no
    peer) and without target lines; ``--ops send_recv`` alone is refused."""
    proc = _bench(1, *QUICK, *ONE_RANK, "--ops", "all_reduce,send_recv", "--max-bytes", "64",
                  "--impls", "spmd,mpi4py", "--fusion-arrays", "0", timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "spmd bench: 1 rank(s)" in proc.stdout and "== all_reduce" in proc.stdout
    assert "== send_recv" not in proc.stdout and "== targets" not in proc.stdout
    proc = _bench(1, *QUICK, *ONE_RANK, "--ops", "send_recv", timeout=120)
    assert proc.returncode != 0 and "send_recv needs two ranks" in proc.stdout
