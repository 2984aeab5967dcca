#!/usr/bin/env bash
# The whole GPU check in one call (see shared/GPU.md): MPI availability, `spmd info`, the
# GPU test suite with cupy arrays at world sizes 1, 2 and 4 (MPI through pinned host
# staging, and directly where MPI is GPU-aware; NCCL as WORLD at size 1 and in groups
# of size 1), the 256 MiB all_reduce benchmark, then a short summary, printed last.
#
#   tests/gpu/run.sh                     full logs in a temporary folder; with $OUT set
#                                        they end up in $OUT/gpu-check-logs.tgz and the
#                                        summary in $OUT/summary.txt
#   SIZES="1 2" tests/gpu/run.sh         other world sizes
#   SPMD_GPU_DEPS=/path tests/gpu/run.sh packages installed with `pip install --target
#                                        /path mpich pytest-mpi` when the machine has no MPI
set -uo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
SIZES=${SIZES:-"1 2 4"}
LIMIT=${LIMIT:-900}
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/spmd-gpu.XXXXXX")
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # spmd from this checkout
if [ -n "${SPMD_GPU_DEPS:-}" ]; then
    DEPS=$(cd "$SPMD_GPU_DEPS" && pwd)
    export PYTHONPATH="$DEPS:$PYTHONPATH" PATH="$DEPS/bin:$PATH"
    export LD_LIBRARY_PATH="$DEPS/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
summary=()
failed=0
note() { summary+=("$1"); echo "== $1"; }
finish() {  # print the summary last; pack the logs into $OUT when it is set
    {
        printf '\n=== summary (logs in %s) ===\n' "$LOGS"
        printf '  %s\n' "${summary[@]}"
        echo "GPU check: $1"
    } | tee "$LOGS/summary.txt"
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT" && cp "$LOGS/summary.txt" "$OUT/" &&
            tar czf "$OUT/gpu-check-logs.tgz" -C "$LOGS" .
    fi
}

# -- the machine ------------------------------------------------------------------------
{ nvidia-smi -L 2>&1 || echo "nvidia-smi: not found"; } | tee "$LOGS/gpu.log"
if ! timeout 120 "$PYTHON" -c "from mpi4py import MPI; print(MPI.Get_library_version())" \
        >"$LOGS/mpi.log" 2>&1; then
    cat "$LOGS/mpi.log"
    note "MPI: mpi4py/MPI missing (install mpich and pytest-mpi with pip --target DIR, then SPMD_GPU_DEPS=DIR)"
    finish "not run"
    exit 2
fi
note "MPI: $(head -n 1 "$LOGS/mpi.log" | tr -s ' ')"
MPIEXEC=${SPMD_MPIEXEC:-$(command -v mpiexec || true)}
if [ -z "$MPIEXEC" ]; then
    note "MPI: no mpiexec on PATH (set SPMD_MPIEXEC)"; finish "not run"; exit 2
fi
MPIFLAGS=()
if "$MPIEXEC" --version 2>/dev/null | grep -q "Open MPI"; then
    MPIFLAGS=(--oversubscribe --allow-run-as-root)
fi
for m in cupy cupy.cuda.nccl; do
    v=$(timeout 120 "$PYTHON" -c "import warnings; warnings.simplefilter('ignore'); import $m as x; print(getattr(x, '__version__', 'nccl available=%s' % getattr(x, 'available', '?')))" 2>&1 | tail -n 1)
    note "$m: $v"
done

# -- spmd info --------------------------------------------------------------------------
timeout 300 "$MPIEXEC" "${MPIFLAGS[@]}" -n 2 "$PYTHON" -m spmd info >"$LOGS/info.log" 2>&1
rc=$?; cat "$LOGS/info.log"
note "spmd info -n 2: exit $rc; $(grep -m1 gpu_aware_mpi "$LOGS/info.log" | tr -s ' ')"
[ $rc -ne 0 ] && failed=1

# -- the GPU suite at each size ---------------------------------------------------------
for n in $SIZES; do
    log="$LOGS/suite_n$n.log"
    timeout -k 10 "$LIMIT" "$MPIEXEC" "${MPIFLAGS[@]}" -n "$n" "$PYTHON" tests/mpi_pytest.py \
        "$LOGS/ranks_n$n" -q -p no:cacheprovider -rs -m mpi \
        tests/test_gpu_collectives.py tests/test_gpu_nccl.py tests/test_gpu_host.py >"$log" 2>&1
    rc=$?
    tail -n 25 "$log"
    note "suite -n $n: exit $rc; $(grep -E '(passed|failed|error)' "$log" | tail -n 1)"
    [ $rc -ne 0 ] && failed=1
done

# -- benchmark: 256 MiB float32 all_reduce ----------------------------------------------
bench() {  # label, ranks, args...
    local label=$1 n=$2; shift 2
    timeout 600 "$MPIEXEC" "${MPIFLAGS[@]}" -n "$n" "$PYTHON" benchmarks/gpu_allreduce.py "$@" \
        >"$LOGS/bench_$label.log" 2>&1
    local rc=$?
    cat "$LOGS/bench_$label.log"
    note "bench $label: exit $rc; $(grep -m1 median "$LOGS/bench_$label.log" | tr -s ' ')"
    [ $rc -ne 0 ] && failed=1
}
bench nccl_n1 1 --backend nccl --mib 256
SPMD_CUDA_AWARE_MPI=0 bench staging_n2 2 --backend mpi --mib 256
if grep -q "gpu_aware_mpi *yes" "$LOGS/info.log"; then
    bench direct_n2 2 --backend mpi --mib 256
fi

if [ $failed -ne 0 ]; then finish FAILED; exit 1; fi
finish passed
