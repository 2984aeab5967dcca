#!/usr/bin/env bash
# Run the whole test suite: the MPI tests at world sizes 1, 2, 3 and 4, then the tests
# that start their own jobs (examples, torch differential test, stores, SLURM scripts).
# Every job runs under a wall-clock limit; the script fails if any part fails.
#
#   tests/run.sh               all of it
#   SIZES="2 4" tests/run.sh   other world sizes for the MPI part
#
# Uses python and mpiexec from PATH (or $PYTHON / $SPMD_MPIEXEC).
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
MPIEXEC=${SPMD_MPIEXEC:-$(command -v mpiexec || true)}
SIZES=${SIZES:-"1 2 3 4"}
LIMIT=${LIMIT:-900}            # seconds for one mpiexec job
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/spmd-tests.XXXXXX")
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1

if [ -z "$MPIEXEC" ]; then
    echo "tests/run.sh: no mpiexec on PATH; install spmd[mpich] or set SPMD_MPIEXEC" >&2
    exit 2
fi
MPIFLAGS=()
case "$("$MPIEXEC" --version 2>/dev/null)" in   # Open MPI 4 says "OpenRTE", 5 "Open MPI"
    *"Open MPI"*|*OpenRTE*) MPIFLAGS=(--oversubscribe --allow-run-as-root) ;;
esac

failed=()
summary=()
for n in $SIZES; do
    echo "=== MPI tests at world size $n ==="
    timeout -k 10 "$LIMIT" "$MPIEXEC" "${MPIFLAGS[@]}" -n "$n" "$PYTHON" tests/mpi_pytest.py \
        "$LOGS/n$n" -q -p no:cacheprovider -m mpi tests/
    rc=$?
    if [ $rc -ne 0 ]; then
        failed+=("mpi n=$n (exit $rc)")
        for f in "$LOGS/n$n"/rank*.log; do
            [ -f "$f" ] && { echo "--- tail of $f"; tail -n 40 "$f"; }
        done
    fi
    summary+=("mpi n=$n: exit $rc")
done

echo "=== tests that launch their own jobs ==="
timeout -k 10 "$LIMIT" "$PYTHON" -m pytest -q -p no:cacheprovider -m "not mpi" -rs tests/
rc=$?
[ $rc -ne 0 ] && failed+=("plain pytest (exit $rc)")
summary+=("plain: exit $rc")

echo "=== summary ==="
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -ne 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all test runs passed"
