#!/usr/bin/env bash
# The whole GPU check in one run of at most $BUDGET seconds (one call on a GPU machine
# is limited to 10 minutes; see shared/GPU.md): the GPU and CuPy, MPI (installed from
# wheels carried in .whl/ when the machine has none), `spmd info`, the GPU suite with
# cupy arrays at world sizes 1, 2 and 4 (MPI through pinned host staging, directly
# where MPI is GPU-aware; NCCL as WORLD at size 1 and in groups of size 1; MPMD links
# between the even and odd ranks, staged and direct), NCCL at 2
# and 4 ranks on one GPU with a different NCCL_HOSTID per rank (over sockets), and the
# 256 MiB float32 all_reduce benchmark (NCCL at 1 rank, staging at 2), torch DDP and
# FSDP2 on CUDA tensors through init_process_group("spmd") at 2 ranks (NCCL, and MPI
# staging), an NCCL job that idles past its timeout and goes on, `spmd bench --device
# cuda` (spmd beside torch's NCCL and raw CuPy NCCL), and the GPU example
# slurm/gpu.sbatch runs.  The last line printed is a one-line summary.
#
# The same GPU tests run in CI without a GPU on spmd.testing.device_double
# (SPMD_TEST_DEVICE=double in tests/run.sh); this script is what only a GPU can show.
#
#   OUT=/path tests/gpu/run.sh     full logs in $OUT/gpu-check (else a temporary folder)
#   SIZES="1 2" NCCL_SIZES="2" BUDGET=300 tests/gpu/run.sh
#
# Exit status: 0 passed, 1 something failed, 2 not run (no GPU, no CuPy, no MPI).
#
# A bare GPU machine has no MPI library, no pytest-mpi and no package registry.  Fill
# .whl/ (git ignores it; carry it along) beforehand, on any machine with pip:
#
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 \
#       -d .whl mpich mpi4py pytest-mpi
#
# What is missing is then installed with `pip install --no-index --prefix` (not
# --target, which drops the MPICH wheel's lib/ folder) into $SPMD_GPU_DEPS.
set -uo pipefail
cd "$(dirname "$0")/../.."

START=$SECONDS
BUDGET=${BUDGET:-540}
PYTHON=${PYTHON:-python3}
SIZES=${SIZES:-"1 2 4"}
NCCL_SIZES=${NCCL_SIZES:-"2 4"}
WHEELS=${SPMD_GPU_WHEELS:-.whl}
DEPS=${SPMD_GPU_DEPS:-${TMPDIR:-/tmp}/spmd-gpu-deps}
if [ -n "${OUT:-}" ]; then LOGS=$OUT/gpu-check; else LOGS=$(mktemp -d "${TMPDIR:-/tmp}/spmd-gpu.XXXXXX"); fi
mkdir -p "$LOGS"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # spmd from this checkout
SUITE=(tests/gpu/test_gpu_collectives.py tests/gpu/test_gpu_nccl.py tests/gpu/test_gpu_host.py tests/gpu/test_gpu_mpmd.py)

summary=()   # one line per step, printed at the end
short=()     # the same, compressed into the last line
failed=0
note() { summary+=("$1"); echo "== $1"; }
finish() {  # finish VERDICT EXIT: the summary, then the one-line verdict, last
    {
        printf '\n=== summary (%ss; logs in %s) ===\n' "$((SECONDS - START))" "$LOGS"
        printf '  %s\n' "${summary[@]}"
        echo "GPU check: $1 in $((SECONDS - START))s | $(IFS='|'; echo "${short[*]}")"
    } | tee "$LOGS/summary.txt"
    exit "$2"
}
left() { echo $((BUDGET - (SECONDS - START))); }

# step NAME CAP CMD...: run CMD under min(CAP, time left) seconds, log to NAME.log
step() {
    local name=$1 cap=$2; shift 2
    local t; t=$(left); t=$((t - 15 < cap ? t - 15 : cap))
    if [ "$t" -lt 10 ]; then
        note "$name: not run, out of time"; short+=("$name: no time"); failed=1; return 1
    fi
    timeout -k 5 "$t" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    tail -n 15 "$LOGS/$name.log"
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "($name: killed after ${t}s)" >>"$LOGS/$name.log"
    [ $rc -ne 0 ] && failed=1
    return $rc
}
outcome() {  # the pytest result line of a log ("12 passed, 3 skipped in 4.5s")
    grep -E '(passed|failed|error|skipped|deselected)' "$1" | grep -E ' in [0-9.]+s' | tail -n 1 |
        tr -d '=' | sed 's/^ *//'
}

# -- the machine: a GPU and CuPy ------------------------------------------------------------
{ timeout 20 nvidia-smi -L 2>&1 || echo "nvidia-smi: not available"; } | tee "$LOGS/gpu.log"
probe='import warnings; warnings.simplefilter("ignore")
import cupy as cp
n = cp.cuda.runtime.getDeviceCount()
from cupy.cuda import nccl
v = nccl.get_version() if getattr(nccl, "available", True) else "unavailable"
print(f"cupy {cp.__version__}, {n} device(s), nccl {v}")
raise SystemExit(0 if n > 0 else 3)'
timeout 120 "$PYTHON" -c "$probe" >"$LOGS/cupy.log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
    why=$(tail -n 1 "$LOGS/cupy.log")
    note "GPU: none usable here (exit $rc: $why)"; short+=("no GPU")
    finish "not run (no GPU: $why)" 2
fi
note "GPU: $(tail -n 1 "$LOGS/cupy.log")"; short+=("$(tail -n 1 "$LOGS/cupy.log")")

# -- MPI: what is missing comes from the carried wheels -------------------------------------
missing=()
"$PYTHON" -c "import mpi4py" 2>/dev/null || missing+=(mpi4py)
"$PYTHON" -c "import pytest_mpi" 2>/dev/null || missing+=(pytest-mpi)
command -v mpiexec >/dev/null || missing+=(mpich)
if [ ${#missing[@]} -ne 0 ]; then
    timeout 120 "$PYTHON" -m pip install --no-index --no-deps --ignore-installed --quiet \
        --find-links "$WHEELS" --prefix "$DEPS" "${missing[@]}" >"$LOGS/install.log" 2>&1
    rc=$?
    site=$(find "$DEPS" -type d -name site-packages 2>/dev/null | head -n 1)
    export PATH="$DEPS/bin:$PATH" PYTHONPATH="${site:+$site:}$PYTHONPATH"
    export LD_LIBRARY_PATH="$DEPS/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    note "install ${missing[*]} from $WHEELS: exit $rc"
    [ $rc -ne 0 ] && { cat "$LOGS/install.log"; short+=("install failed"); }
fi
if ! timeout 60 "$PYTHON" -c "from mpi4py import MPI; print(MPI.Get_library_version())" \
        >"$LOGS/mpi.log" 2>&1 || ! command -v mpiexec >/dev/null; then
    cat "$LOGS/mpi.log"
    note "MPI: not usable (fill $WHEELS: see the top of this script)"; short+=("no MPI")
    finish "not run (no MPI)" 2
fi
note "MPI: $(head -n 1 "$LOGS/mpi.log" | tr -s ' ')"
MPIRUN=(mpiexec)
case "$(mpiexec --version 2>/dev/null)" in
    *"Open MPI"*|*OpenRTE*) MPIRUN+=(--oversubscribe --allow-run-as-root) ;;
esac

# -- spmd info -----------------------------------------------------------------------------
step info 60 "${MPIRUN[@]}" -n 2 "$PYTHON" -m spmd info
rc=$?
aware=$(grep -m1 gpu_aware_mpi "$LOGS/info.log" | sed 's/.*gpu_aware_mpi *:* *//')
note "spmd info -n 2: exit $rc; GPU-aware MPI: ${aware:-?}"; short+=("info $rc")

# -- the GPU suite: staging (and direct where MPI is aware), NCCL at size 1 -----------------
for n in $SIZES; do
    step "suite_n$n" 150 "${MPIRUN[@]}" -n "$n" "$PYTHON" tests/mpi_pytest.py "$LOGS/ranks_suite_n$n" \
        -q -p no:cacheprovider -rs -m mpi "${SUITE[@]}"
    rc=$?
    note "suite -n $n (staging, direct if aware, NCCL size 1): exit $rc; $(outcome "$LOGS/suite_n$n.log")"
    short+=("n$n $(outcome "$LOGS/suite_n$n.log" | sed 's/ in .*//')")
done

# -- benchmark: 256 MiB float32 all_reduce ---------------------------------------------------
bench() {  # bench LABEL N ARGS...
    local label=$1 n=$2; shift 2
    step "bench_$label" 90 "${MPIRUN[@]}" -n "$n" "$PYTHON" benchmarks/gpu_allreduce.py --mib 256 "$@"
    local rc=$? row
    row=$(grep -m1 median "$LOGS/bench_$label.log" | tr -s ' ' | sed 's/^ //')
    note "bench $label: exit $rc; $row (ms/call algbw busbw)"
    short+=("$label $(echo "$row" | cut -d' ' -f1) ms")
}
bench nccl_n1 1 --backend nccl
SPMD_CUDA_AWARE_MPI=0 bench staging_n2 2 --backend mpi

# -- NCCL with several ranks on the one GPU: a different NCCL_HOSTID per rank ----------------
# NCCL then sees different hosts and connects them over sockets on the loopback.
for n in $NCCL_SIZES; do
    step "nccl_hostid_n$n" 150 env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo \
        "${MPIRUN[@]}" -n "$n" bash -c \
        'NCCL_HOSTID=spmd-rank${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}} exec "$@"' hostid \
        "$PYTHON" tests/mpi_pytest.py "$LOGS/ranks_nccl_n$n" -q -p no:cacheprovider -rs -m mpi \
        -k nccl tests/gpu/test_gpu_collectives.py tests/gpu/test_gpu_nccl.py
    rc=$?
    note "NCCL -n $n with NCCL_HOSTID per rank: exit $rc; $(outcome "$LOGS/nccl_hostid_n$n.log")"
    short+=("nccl n$n $(outcome "$LOGS/nccl_hostid_n$n.log" | sed 's/ in .*//')")
done

# -- torch on CUDA tensors through init_process_group("spmd"): DDP, FSDP1, FSDP2 at 2 ranks,
# NCCL (a different NCCL_HOSTID per rank) and MPI through host staging ------------------
HOSTID=(env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo)
PER_RANK=(bash -c 'NCCL_HOSTID=spmd-rank${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}} exec "$@"' hostid)
for script in ddp fsdp1 fsdp2; do
    step "torch_${script}_nccl" 90 "${HOSTID[@]}" "${MPIRUN[@]}" -n 2 "${PER_RANK[@]}" \
        "$PYTHON" "tests/torch_backend/${script}_script.py" --device cuda
    rc=$?
    note "torch $script on CUDA, NCCL -n 2: exit $rc; $(grep -c 'matches single-process' "$LOGS/torch_${script}_nccl.log") of 2 ranks match"
    short+=("$script nccl $rc")
    step "torch_${script}_mpi" 90 env SPMD_CUDA_AWARE_MPI=0 "${MPIRUN[@]}" -n 2 \
        "$PYTHON" "tests/torch_backend/${script}_script.py" --device cuda --spmd-backend cpu:mpi,cuda:mpi
    rc=$?
    note "torch $script on CUDA, cpu:mpi,cuda:mpi -n 2: exit $rc; $(grep -c 'matches single-process' "$LOGS/torch_${script}_mpi.log") of 2 ranks match"
    short+=("$script mpi $rc")
done

# -- a healthy NCCL job idles past its 1 s timeout, then goes on ---------------------------
step idle_n1 60 "${MPIRUN[@]}" -n 1 "$PYTHON" tests/programs/nccl_idle.py
rc=$?
note "NCCL job idle past its timeout -n 1: exit $rc; $(grep -c 'nccl_idle OK' "$LOGS/idle_n1.log") OK lines"
short+=("idle n1 $rc")
step idle_n2 60 "${HOSTID[@]}" "${MPIRUN[@]}" -n 2 "${PER_RANK[@]}" "$PYTHON" tests/programs/nccl_idle.py
rc=$?
note "NCCL job idle past its timeout -n 2 (NCCL_HOSTID): exit $rc; $(grep -c 'nccl_idle OK' "$LOGS/idle_n2.log") OK lines"
short+=("idle n2 $rc")

# -- per-call cost and bandwidth beside torch's NCCL and raw CuPy NCCL --------------------
step bench_gpu 120 "${MPIRUN[@]}" -n 1 "$PYTHON" -m spmd bench --device cuda --one-rank
rc=$?
note "spmd bench --device cuda --one-rank -n 1: exit $rc; $(grep -m1 '^spmd-cupy ' "$LOGS/bench_gpu.log")"
grep -E 'target|us/call|GB/s' "$LOGS/bench_gpu.log" | head -n 20
short+=("bench gpu $rc")

# -- the GPU example slurm/gpu.sbatch runs, at 2 ranks on the one GPU (so through MPI) ----
step example_n2 60 "${MPIRUN[@]}" -n 2 "$PYTHON" examples/dp_mlp_gpu.py --backend mpi
rc=$?
note "examples/dp_mlp_gpu.py -n 2 --backend mpi: exit $rc; $(grep -c 'dp_mlp_gpu OK' "$LOGS/example_n2.log") OK lines"
short+=("example $rc")

if [[ "$aware" == yes* ]]; then
    bench direct_n2 2 --backend mpi
else
    note "GPU-aware MPI: not here (${aware:-?}); the direct path was not exercised"
fi

if [ $failed -ne 0 ]; then finish FAILED 1; fi
finish passed 0
