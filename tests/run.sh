#!/usr/bin/env bash
# Run the test suite, each kind of test where its result can differ
# (tests/conftest.py says what the folders hold), in two parts:
#
#   tests/run.sh           the quick part (README's test command, ~7 min on 2 cores):
#                            tests/mpi/ and tests/engines/  under mpiexec at world sizes
#                                                           1, 2, 3 and 4
#                            tests/gpu/   on the device double (CuPy, CUDA, NCCL on CPU)
#                                         at world size 2
#                            tests/unit/ and tests/jobs/    in one process (jobs/ start
#                                         their own jobs), but the jobs marked slow
#   tests/run.sh rest      what the quick part leaves out:
#                            tests/gpu/ on the device double at world sizes 1, 3 and 4
#                            tests/engines/ with the shared-memory engine forced on, off,
#                                         and the compiled call path off
#                            torch's own distributed suite on spmd, as itself, as gloo
#                                         and as mpi
#                            the MPI part on other MPIs (OTHER_MPIS) and the torch-facing
#                                         tests on other torch releases (TORCH_VENVS)
#                            the jobs marked slow (whole-world layouts at 8-16 ranks,
#                                         training under torch, objects over 2 GiB, ...)
#   tests/run.sh all       both (CI: .ci/run runs README's command, then the rest)
#
# Every job runs under a wall-clock limit; the script fails if any part fails.
#
#   SIZES="2 4" tests/run.sh   other world sizes for the MPI part (DOUBLE_SIZES and
#                              REST_DOUBLE_SIZES: the GPU tests on the device double;
#                              SHM_SIZES and SHM_OFF_SIZES: the engine runs forced on,
#                              off; PYTHON_PATH_SIZES: with the compiled call path off)
#   OTHER_MPIS="VENV..." tests/run.sh rest
#                              the MPI part again on other MPI libraries, each from a
#                              virtual environment with spmd and that MPI's wheel in it
#                              (OTHER_MPI_SIZES, OTHER_MPI_SHM_SIZES: where it runs); on
#                              Open MPI also the jobs that lose a rank (ULFM)
#   JOB_WORKERS=0 tests/run.sh  the job-launching tests in one process (default: 3
#                              pytest-xdist workers side by side; also for the jobs run
#                              on other MPIs and torch releases; ULFM_WORKERS, default 2,
#                              for the jobs that lose a rank)
#   TORCH_VENVS="VENV..." tests/run.sh rest
#                              the torch-facing tests at 2 ranks again with other torch
#                              releases, each from a virtual environment with spmd[mpich,
#                              test,trainers] and that torch (TORCH_VENV_SUITE_RUNS: its
#                              runs of torch's suite, NAME:RANKS)
#
# Uses python and mpiexec from PATH (or $PYTHON / $SPMD_MPIEXEC).
set -uo pipefail
cd "$(dirname "$0")/.."

PART=${1:-quick}
case "$PART" in
    quick|rest|all) ;;
    *) echo "usage: tests/run.sh [quick|rest|all] (got '$PART')" >&2; exit 2 ;;
esac
quick() { [ "$PART" != rest ]; }
rest() { [ "$PART" != quick ]; }

PYTHON=${PYTHON:-python}
MPIEXEC=${SPMD_MPIEXEC:-$(command -v mpiexec || true)}
SIZES=${SIZES:-"1 2 3 4"}
SHM_SIZES=${SHM_SIZES:-"2 3 4"}    # SPMD_SHM=force (at 1 rank it has no peer to share with)
SHM_OFF_SIZES=${SHM_OFF_SIZES:-"3"}  # SPMD_SHM=0 (an odd size; the quick part ran them all)
PYTHON_PATH_SIZES=${PYTHON_PATH_SIZES:-"3"}  # SPMD_FASTCALL=0 (likewise)
LIMIT=${LIMIT:-900}            # seconds for one mpiexec job
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/spmd-tests.XXXXXX")
# What the jobs that kill or leave out a rank leave behind, removed when the run ends:
# the device double's NCCL files of a communicator a rank never joined (kept in a
# directory of this run's), and the shared-memory segments of MPI's ranks that were
# killed before they could unlink them (made since the run began, mapped by nobody).
export SPMD_DEVICE_DOUBLE_DIR=$LOGS/device-double
mkdir -p "$SPMD_DEVICE_DOUBLE_DIR"
touch "$LOGS/started"
leftovers() {
    rm -rf "$SPMD_DEVICE_DOUBLE_DIR"
    local mapped f
    mapped=$(cat /proc/[0-9]*/maps 2>/dev/null | grep -o '/dev/shm/[^ ]*' | sort -u)
    find /dev/shm -maxdepth 1 -type f -newer "$LOGS/started" \
        \( -name 'mpich_shm_*' -o -name 'sm_segment.*' \) 2>/dev/null |
    while read -r f; do
        grep -qxF "$f" <<<"$mapped" || rm -f "$f"
    done
}
trap leftovers EXIT
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
# The suite starts thousands of Python processes: let them write and reuse compiled
# modules (spmd's, the tests' with pytest's assertion rewriting), where an environment
# that says PYTHONDONTWRITEBYTECODE would make each compile them from source again
# (a quarter of a second per process; over a second per rank of each MPI test run).
unset PYTHONDONTWRITEBYTECODE

if [ -z "$MPIEXEC" ]; then
    echo "tests/run.sh: no mpiexec on PATH; install spmd[mpich] or set SPMD_MPIEXEC" >&2
    exit 2
fi
mpi_flags() {  # the flags $MPIEXEC needs here (ranks may outnumber cores; CI runs as root)
    MPIFLAGS=()
    case "$("$MPIEXEC" --version 2>/dev/null)" in   # Open MPI 4 says "OpenRTE", 5 "Open MPI"
        *"Open MPI"*|*OpenRTE*) MPIFLAGS=(--oversubscribe --allow-run-as-root) ;;
    esac
}
mpi_flags

failed=()
summary=()
mpi_run() {  # mpi_run NAME N [VAR=VALUE...]: the MPI tests of PATHS at world size N
    local name=$1 n=$2
    shift 2
    echo "=== ${MPI_LABEL:-}MPI tests at world size $n${*:+ ($*)} ==="
    local start=$SECONDS
    env "$@" timeout -k 10 "$LIMIT" "$MPIEXEC" "${MPIFLAGS[@]}" -n "$n" "$PYTHON" \
        tests/mpi_pytest.py "$LOGS/${name//[^A-Za-z0-9=.-]/_}" -q -p no:cacheprovider -m mpi "${PATHS[@]}"
    local rc=$?
    if [ $rc -ne 0 ]; then
        failed+=("$name (exit $rc)")
        for f in "$LOGS/${name//[^A-Za-z0-9=.-]/_}"/rank*.log; do
            [ -f "$f" ] && { echo "--- tail of $f"; tail -n 40 "$f"; }
        done
    fi
    summary+=("$name: exit $rc ($((SECONDS - start)) s)")
}

if quick; then
    PATHS=(tests/mpi tests/engines)
    for n in $SIZES; do
        mpi_run "mpi n=$n" "$n"
    done
fi
# The GPU tests (collectives on cupy arrays through staging and NCCL, the NCCL engine,
# its watchdog and diagnoses) on spmd.testing.device_double: CuPy, CUDA streams and
# events and NCCL stood in for on CPU, so their logic is checked where there is no GPU.
PATHS=(tests/gpu)
sizes=""
quick && sizes="$sizes ${DOUBLE_SIZES:-2}"
rest && sizes="$sizes ${REST_DOUBLE_SIZES:-1 3 4}"
for n in $sizes; do
    mpi_run "gpu double n=$n" "$n" SPMD_TEST_DEVICE=double
done
if rest; then
    # The data path again with the shared-memory engine taking every op it can, at
    # every size (small messages included), then with it off.
    PATHS=(tests/engines)
    for n in $SHM_SIZES; do
        mpi_run "mpi n=$n shm=force" "$n" SPMD_SHM=force
    done
    for n in $SHM_OFF_SIZES; do
        mpi_run "mpi n=$n shm=off" "$n" SPMD_SHM=0
    done
    # The blocking ops' compiled call path (spmd.backends.mpi._fastcall, where pip built
    # it) off: the Python path it stands in for takes the same calls.
    if "$PYTHON" -c "import spmd.backends.mpi._fastcall" 2>/dev/null; then
        for n in $PYTHON_PATH_SIZES; do
            mpi_run "mpi n=$n fastcall=off" "$n" SPMD_FASTCALL=0
        done
    else
        echo "=== spmd.backends.mpi._fastcall is not built: every run above took the Python path ==="
    fi
fi

# torch's own distributed test suite against the spmd torch backend, when torch is here:
# as itself, then told its backend is "gloo" and "mpi" (torch's decorators skip a third
# of the suite by the backend's name; every group stays spmd's, see run_torch_suite.py).
# NAME:RANKS; torch's suite runs its MPI tests at 3 ranks or more.  As itself at 2 ranks
# only: told "gloo", it passes all that it passes as itself but test_get_backend.
if rest && "$PYTHON" -c "import torch.distributed, expecttest" 2>/dev/null; then
    for run in ${TORCH_SUITE_RUNS:-spmd:2 gloo:2 gloo:3 mpi:3}; do
        name=${run%:*} n=${run#*:}
        as=(); [ "$name" != spmd ] && as=(--as "$name")
        echo "=== torch distributed_test on the spmd backend (as $name), $n ranks ==="
        start=$SECONDS
        timeout -k 10 "$LIMIT" "$MPIEXEC" "${MPIFLAGS[@]}" -n "$n" "$PYTHON" \
            tests/torch_backend/run_torch_suite.py "${as[@]}"
        rc=$?
        [ $rc -ne 0 ] && failed+=("torch suite as $name n=$n (exit $rc)")
        summary+=("torch suite as $name n=$n: exit $rc ($((SECONDS - start)) s)")
    done
elif rest; then
    echo "=== torch distributed_test: skipped (torch or expecttest is not installed) ==="
fi

# The MPI part on other MPI libraries (Open MPI...), each from its own virtual
# environment: at a few sizes, and with the shared-memory engine forced, where an MPI
# behaves differently (progress, shared-memory windows, persistent collectives, error
# classes); what cannot differ between MPIs runs once, above.
if ! rest; then    # other MPIs and torch releases belong to the rest
    if [ -n "${OTHER_MPIS:-}${TORCH_VENVS:-}" ]; then
        echo "=== OTHER_MPIS and TORCH_VENVS run with tests/run.sh rest (or all), not in the quick part ==="
    fi
    OTHER_MPIS="" TORCH_VENVS=""
fi
for venv in ${OTHER_MPIS:-}; do
    saved=("$PYTHON" "$MPIEXEC")
    PYTHON="$venv/bin/python" MPIEXEC="$venv/bin/mpiexec"
    mpi_flags
    library=$("$PYTHON" -c "from mpi4py import MPI; v, n = MPI.get_vendor(); print(v, '.'.join(map(str, n)))")
    MPI_LABEL="$library: "
    PATHS=(tests/mpi tests/engines)
    for n in ${OTHER_MPI_SIZES:-2}; do   # an even size: where Intel MPI's persistent plans stalled
        mpi_run "$library: mpi n=$n" "$n"
    done
    PATHS=(tests/engines)
    for n in ${OTHER_MPI_SHM_SIZES:-3}; do   # the data path at an odd size, windows forced
        mpi_run "$library: mpi n=$n shm=force" "$n" SPMD_SHM=force
    done
    # The jobs whose outcome depends on the MPI: spawn (its launcher), the launch variables,
    # a rank that raises, is killed, never comes, comes late or exits early (error
    # classes, cancelling a receive, how the launcher ends the job), a stalled test kept
    # to itself.
    # (A Hydra ends a job as MPICH's does: the reliability jobs run on Open MPI's launcher.)
    # Tests marked same_on_every_mpi run on the first MPI only (with the job tests below).
    jobs=(tests/unit/test_launch.py tests/jobs/test_spawn.py tests/jobs/test_stall_isolation.py
          tests/jobs/test_late_peer_jobs.py tests/jobs/test_exit_jobs.py)
    [ "${#MPIFLAGS[@]}" -gt 0 ] && jobs+=(tests/jobs/test_reliability_jobs.py)
    echo "=== ${MPI_LABEL}jobs ==="
    start=$SECONDS
    PATH="$venv/bin:$PATH" timeout -k 10 "$LIMIT" "$PYTHON" -m pytest -q -p no:cacheprovider \
        -rs -m "not same_on_every_mpi" -n "${JOB_WORKERS:-3}" --dist loadgroup "${jobs[@]}"
    rc=$?
    [ $rc -ne 0 ] && failed+=("$library: jobs (exit $rc)")
    summary+=("$library: jobs: exit $rc ($((SECONDS - start)) s)")
    # A dead rank the job survives: Open MPI's ULFM (mpiexec --with-ft ulfm), ranks killed
    # at each point at 3 and 4 ranks, and the fault-tolerant training example; with torch
    # in this environment (CI: 2.14), torch's reconfigure and the self-healing DDP example.
    if [ "${#MPIFLAGS[@]}" -gt 0 ]; then   # Open MPI's launcher
        echo "=== ${MPI_LABEL}jobs that lose a rank (ULFM) ==="
        start=$SECONDS
        # Two workers, not three: survivors agreeing (MPI_Comm_agree) on 2 cores busy-polled
        # by three 4-rank jobs at once once took longer than heal's patience.
        PATH="$venv/bin:$PATH" timeout -k 10 "$LIMIT" "$PYTHON" -m pytest -q -p no:cacheprovider \
            -rs -n "${ULFM_WORKERS:-2}" --dist loadgroup tests/jobs/test_ulfm_jobs.py
        rc=$?
        [ $rc -ne 0 ] && failed+=("$library: ULFM jobs (exit $rc)")
        summary+=("$library: ULFM jobs: exit $rc ($((SECONDS - start)) s)")
    fi
    PYTHON=${saved[0]} MPIEXEC=${saved[1]} MPI_LABEL=""
    mpi_flags
done

# Other torch releases (CI: 2.14 beside the 2.13 above), each from a virtual environment
# with spmd, MPICH, that torch and the trainers: the torch-facing tests at 2 ranks, a
# subset chosen to take about two minutes (the backend's MPI tests; torch's suite told
# "gloo", whose passes include all of the run as spmd's but test_get_backend; DDP,
# FSDP1/2 and DTensor in one job; what import torch makes of the "mpi" name, and a job
# under it; Lightning and Accelerate, which with that job train with DDP; torch 2.14's
# reconfigure, planned: reordered, a rank left out, a process spawn_peers started, one
# of another mpiexec).
TORCH_VENV_JOBS=(
    tests/jobs/test_torch_backend_jobs.py::test_import_torch_registers_without_starting_mpi
    "tests/jobs/test_torch_training_jobs.py::test_ddp_fsdp1_fsdp2_and_dtensor_match_their_references[2]"
    "tests/jobs/test_torch_mpi_name.py::test_off_by_default_torch_is_untouched[None]"
    tests/jobs/test_torch_mpi_name.py::test_on_answers_without_starting_mpi
    tests/jobs/test_torch_mpi_name.py::test_a_torch_built_with_mpi_keeps_its_own
    "tests/jobs/test_torch_mpi_name.py::test_a_script_for_torchs_mpi_backend_runs_on_spmd[2]"
    "tests/jobs/test_trainers_jobs.py::test_lightning_ddp_strategy_on_spmd_trains_as_gloo[2]"
    "tests/jobs/test_trainers_jobs.py::test_accelerate_multi_cpu_on_spmd_as_mpi_trains_as_gloo[2]"
    "tests/jobs/test_reconfigure_jobs.py::test_reversed_handles_reverse_the_ranks[3]"
    tests/jobs/test_reconfigure_jobs.py::test_a_rank_left_out_the_others_go_on_without_it
    tests/jobs/test_reconfigure_jobs.py::test_a_process_spawn_peers_started_joins
    tests/jobs/test_reconfigure_jobs.py::test_a_process_started_by_its_own_launcher_joins_through_its_port
)
for venv in ${TORCH_VENVS:-}; do
    saved=("$PYTHON" "$MPIEXEC")
    PYTHON="$venv/bin/python" MPIEXEC="$venv/bin/mpiexec"
    mpi_flags
    MPI_LABEL="torch $("$PYTHON" -c "import torch; print(torch.__version__)"): "
    PATHS=(tests/mpi/test_torch_backend.py tests/mpi/test_torch_tensors.py
           tests/mpi/test_torch_call_path.py)
    mpi_run "${MPI_LABEL}mpi n=2" 2
    for run in ${TORCH_VENV_SUITE_RUNS:-gloo:2}; do
        name=${run%:*} n=${run#*:}
        as=(); [ "$name" != spmd ] && as=(--as "$name")
        echo "=== ${MPI_LABEL}torch distributed_test on the spmd backend (as $name), $n ranks ==="
        start=$SECONDS
        timeout -k 10 "$LIMIT" "$MPIEXEC" "${MPIFLAGS[@]}" -n "$n" "$PYTHON" \
            tests/torch_backend/run_torch_suite.py "${as[@]}"
        rc=$?
        [ $rc -ne 0 ] && failed+=("${MPI_LABEL}torch suite as $name n=$n (exit $rc)")
        summary+=("${MPI_LABEL}torch suite as $name n=$n: exit $rc ($((SECONDS - start)) s)")
    done
    echo "=== ${MPI_LABEL}torch jobs ==="
    start=$SECONDS
    PATH="$venv/bin:$PATH" timeout -k 10 "$LIMIT" "$PYTHON" -m pytest -q -p no:cacheprovider \
        -rs -n "${JOB_WORKERS:-3}" --dist loadgroup "${TORCH_VENV_JOBS[@]}"
    rc=$?
    [ $rc -ne 0 ] && failed+=("${MPI_LABEL}torch jobs (exit $rc)")
    summary+=("${MPI_LABEL}torch jobs: exit $rc ($((SECONDS - start)) s)")
    PYTHON=${saved[0]} MPIEXEC=${saved[1]} MPI_LABEL=""
    mpi_flags
done

# Most of these tests wait on jobs of their own (launches, timeouts, a rank that never
# comes): JOB_WORKERS pytest-xdist workers run them side by side (0: in this process).
# The quick part runs all but those marked slow; the rest runs those.
jobs_run() {  # jobs_run NAME MARKERS
    echo "=== tests that launch their own jobs ($1) ==="
    local start=$SECONDS
    timeout -k 10 "$LIMIT" "$PYTHON" -m pytest -q -p no:cacheprovider -m "$2" -rs \
        -n "${JOB_WORKERS:-3}" --dist loadgroup tests/unit tests/jobs
    local rc=$?
    [ $rc -ne 0 ] && failed+=("$1 (exit $rc)")
    summary+=("$1: exit $rc ($((SECONDS - start)) s)")
}
quick && jobs_run "jobs" "not mpi and not slow"
rest && jobs_run "slow jobs" "not mpi and slow"

echo "=== summary ==="
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -ne 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all test runs passed in $SECONDS s"
