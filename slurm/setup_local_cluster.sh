#!/usr/bin/env bash
# Bring up a local SLURM test cluster on THIS machine (Debian/Ubuntu; no
# systemd needed) so that the batch scripts in slurm/ and tests/jobs/test_slurm_scripts.py can run
# for real. Not for production: no accounting, no cgroups, no limits.
#
#   sudo bash slurm/setup_local_cluster.sh      # install + configure + start
#   sudo bash slurm/teardown_local_cluster.sh   # stop the daemons again
#
# Idempotent: safe to run again at any time; it only restarts daemons whose
# configuration changed or that are not running. A change of configuration
# (e.g. another SPMD_SLURM_NODES) while jobs are queued or running is refused
# unless SPMD_SLURM_FORCE=1, because restarting the daemons loses those jobs.
#
# What it does:
#   1. apt-get installs slurm-wlm and munge if any of slurmctld, slurmd,
#      sbatch, srun, sinfo, munged is missing (apt-get update first).
#   2. Ensures a munge key (/etc/munge/munge.key) and a running munged.
#   3. Writes /etc/slurm/slurm.conf: partition "debug", proctrack/linuxproc,
#      task/none, select/cons_tres (CR_CPU), MpiDefault=none (the batch
#      scripts ask for --mpi=pmi2 explicitly), no accounting database.
#   4. Starts slurmctld and one slurmd per node directly (daemonised, pid
#      files /run/slurmctld.pid and /run/slurmd-<node>.pid).
#   5. Waits (bounded: SPMD_SLURM_WAIT seconds, default 60) until `sinfo`
#      reports every node idle; otherwise prints the daemon log tails and
#      exits non-zero.
#   6. Prints a one-line summary.
#
# Nodes (SPMD_SLURM_NODES, default 2):
#   * 1  -> one node named after this host (`hostname -s`). Plain and
#           --multi-prog jobs work; heterogeneous jobs (#SBATCH hetjob) do NOT:
#           Slurm never puts two hetjob components on the same node, so a
#           hetjob stays PENDING (Resources) forever on a one-node cluster.
#   * N>1 -> N emulated nodes <host>-1 .. <host>-N, all on this machine (one
#           slurmd each, listening on ports 17001..), so that multi-node jobs
#           (--nodes=2) and hetjobs can be tested. MPICH treats them as
#           separate nodes (shared memory inside a node, netmod between).
#
# CPUs: every node is declared with SPMD_SLURM_CPUS CPUs (default max(nproc,
# 8)) and SlurmdParameters=config_overrides, so `sbatch -n 4` / `-n 8` jobs
# are scheduled on a 2-core machine: the tasks simply oversubscribe the real
# cores (fine for functional tests, useless for timing).
set -euo pipefail

log() { printf 'setup_local_cluster: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

if [[ ${EUID} -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then
        exec sudo -E bash "$0" "$@"
    fi
    die "must run as root (or with sudo available)"
fi

start_time=${SECONDS}
WAIT=${SPMD_SLURM_WAIT:-60}
HOST=$(hostname -s)
PHYS_CPUS=$(nproc)
CPUS=${SPMD_SLURM_CPUS:-$(( PHYS_CPUS > 8 ? PHYS_CPUS : 8 ))}
NNODES=${SPMD_SLURM_NODES:-2}
[[ ${NNODES} =~ ^[1-9][0-9]*$ ]] || die "SPMD_SLURM_NODES must be a positive integer, got '${NNODES}'"
[[ ${CPUS} =~ ^[1-9][0-9]*$ ]] || die "SPMD_SLURM_CPUS must be a positive integer, got '${CPUS}'"
[[ ${WAIT} =~ ^[0-9]+$ ]] || die "SPMD_SLURM_WAIT must be a number of seconds, got '${WAIT}'"
PARTITION=debug
CONF_DIR=/etc/slurm
CONF=${CONF_DIR}/slurm.conf
LOG_DIR=/var/log/slurm
STATE_DIR=/var/lib/slurm/slurmctld
SPOOL_BASE=/var/lib/slurm
CTLD_PID=/run/slurmctld.pid
MUNGE_KEY=/etc/munge/munge.key
MUNGE_PID=/run/munge/munged.pid

NODES=()
if [[ ${NNODES} -eq 1 ]]; then
    NODES=("${HOST}")
else
    for ((i = 1; i <= NNODES; i++)); do NODES+=("${HOST}-${i}"); done
fi

# ---------------------------------------------------------------- 1. packages
need_install=0
for exe in slurmctld slurmd sbatch srun sinfo scontrol munged munge unmunge; do
    if ! command -v "${exe}" >/dev/null 2>&1 && [[ ! -x /usr/sbin/${exe} ]]; then
        need_install=1
    fi
done
if [[ ${need_install} -eq 1 ]]; then
    command -v apt-get >/dev/null 2>&1 || die "slurm/munge missing and no apt-get to install them"
    log "installing slurm-wlm and munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
export PATH="/usr/sbin:/sbin:${PATH}"

# A daemon counts as running if its pid file names a live process of that name.
pid_alive() {  # pidfile name
    local pidfile=$1 name=$2 pid
    [[ -s ${pidfile} ]] || return 1
    pid=$(<"${pidfile}")
    [[ ${pid} =~ ^[0-9]+$ ]] || return 1
    [[ -r /proc/${pid}/comm ]] || return 1
    [[ $(<"/proc/${pid}/comm") == "${name}" ]]
}

stop_pid() {  # pidfile name: TERM, wait up to 10 s, then KILL
    local pidfile=$1 name=$2 pid i
    if pid_alive "${pidfile}" "${name}"; then
        pid=$(<"${pidfile}")
        kill -TERM "${pid}" 2>/dev/null || true
        for ((i = 0; i < 100; i++)); do
            [[ -d /proc/${pid} ]] || break
            sleep 0.1
        done
        if [[ -d /proc/${pid} ]]; then
            kill -KILL "${pid}" 2>/dev/null || true
            sleep 0.2
        fi
    fi
    rm -f "${pidfile}"
}

show_logs() {
    local f
    for f in /var/log/munge/munged.log "${LOG_DIR}"/slurmctld.log "${LOG_DIR}"/slurmd-*.log; do
        [[ -f ${f} ]] || continue
        echo "----- last 25 lines of ${f} -----" >&2
        tail -n 25 "${f}" >&2 || true
    done
}

munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

# ---------------------------------------------------------------- 2. munge
getent passwd munge >/dev/null || die "user 'munge' missing (munge package not installed correctly?)"
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [[ ! -s ${MUNGE_KEY} ]]; then
    log "creating munge key ${MUNGE_KEY}"
    if command -v mungekey >/dev/null 2>&1; then
        mungekey --create --keyfile="${MUNGE_KEY}" --force
    else
        dd if=/dev/urandom of="${MUNGE_KEY}" bs=1024 count=1 status=none
    fi
fi
chown munge:munge "${MUNGE_KEY}"
chmod 0400 "${MUNGE_KEY}"

if ! munge_ok; then
    stop_pid "${MUNGE_PID}" munged
    log "starting munged"
    runuser -u munge -- munged --force --pid-file="${MUNGE_PID}" \
        || { show_logs; die "munged failed to start"; }
    for ((i = 0; i < 50; i++)); do munge_ok && break; sleep 0.1; done
    munge_ok || { show_logs; die "munge credential round trip failed"; }
fi

# ---------------------------------------------------------------- 3. slurm.conf
if getent passwd slurm >/dev/null; then SLURM_USER=slurm; else SLURM_USER=root; fi
install -d -m 0755 "${CONF_DIR}" "${SPOOL_BASE}"
install -d -o "${SLURM_USER}" -m 0755 "${LOG_DIR}" "${STATE_DIR}"

new_conf=$(mktemp)
trap 'rm -f "${new_conf}"' EXIT
{
    cat <<EOF
# Written by spmd slurm/setup_local_cluster.sh: a local test cluster of
# ${NNODES} node(s) on host ${HOST}. Re-running the script rewrites this file.
ClusterName=spmdlocal
SlurmctldHost=${HOST}(127.0.0.1)
SlurmUser=${SLURM_USER}
AuthType=auth/munge
CryptoType=crypto/munge
# Batch scripts choose the PMI explicitly (srun --mpi=pmi2).
MpiDefault=none
# No cgroups (works in containers): plain /proc process tracking, no binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
# Hetjobs are only started by the backfill scheduler: run it every 2 s.
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Trust the CPU counts below instead of the probed hardware, so that more
# tasks than physical cores can be scheduled (oversubscription on purpose).
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldPidFile=${CTLD_PID}
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
StateSaveLocation=${STATE_DIR}
# %n = node name: one slurmd per (emulated) node.
SlurmdPidFile=/run/slurmd-%n.pid
SlurmdLogFile=${LOG_DIR}/slurmd-%n.log
SlurmdSpoolDir=${SPOOL_BASE}/slurmd-%n
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
EOF
    if [[ ${NNODES} -eq 1 ]]; then
        echo "NodeName=${HOST} NodeAddr=127.0.0.1 CPUs=${CPUS} State=UNKNOWN"
    else
        for ((i = 1; i <= NNODES; i++)); do
            echo "NodeName=${HOST}-${i} NodeHostname=${HOST} NodeAddr=127.0.0.1 Port=$((17000 + i)) CPUs=${CPUS} State=UNKNOWN"
        done
    fi
    echo "PartitionName=${PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
} >"${new_conf}"

conf_changed=0
if [[ ! -f ${CONF} ]] || ! cmp -s "${new_conf}" "${CONF}"; then
    # Restarting with another configuration loses the jobs of the running
    # cluster: refuse while there are any, unless told otherwise.
    if [[ -f ${CONF} ]] && pid_alive "${CTLD_PID}" slurmctld; then
        jobs_now=$(timeout 10 squeue -h -o '%i %T %j' 2>/dev/null || true)
        if [[ -n ${jobs_now} && ${SPMD_SLURM_FORCE:-0} != 1 ]]; then
            die "slurm.conf would change and these jobs would be lost (SPMD_SLURM_FORCE=1 to go on):
${jobs_now}"
        fi
    fi
    log "writing ${CONF} (${NNODES} node(s): ${NODES[*]}; CPUs=${CPUS} each, ${PHYS_CPUS} physical)"
    install -m 0644 "${new_conf}" "${CONF}"
    conf_changed=1
fi

# ---------------------------------------------------------------- 4. daemons
if [[ ${conf_changed} -eq 1 ]]; then
    # Stop every slurmd started from an earlier configuration (the node set
    # may differ), then the controller.
    for pf in /run/slurmd-*.pid /run/slurmd.pid; do
        [[ -e ${pf} ]] && stop_pid "${pf}" slurmd
    done
    stop_pid "${CTLD_PID}" slurmctld
fi
if ! pid_alive "${CTLD_PID}" slurmctld; then
    log "starting slurmctld"
    slurmctld || { show_logs; die "slurmctld failed to start"; }
fi
for node in "${NODES[@]}"; do
    install -d -m 0755 "${SPOOL_BASE}/slurmd-${node}"
    if ! pid_alive "/run/slurmd-${node}.pid" slurmd; then
        log "starting slurmd for node ${node}"
        slurmd -N "${node}" || { show_logs; die "slurmd -N ${node} failed to start"; }
    fi
done

# ---------------------------------------------------------------- 5. wait
up=0
states=""
deadline=$((SECONDS + WAIT))
while ((SECONDS < deadline)); do
    states=" $(timeout 10 sinfo -h -N -p "${PARTITION}" -o '%N=%t' 2>/dev/null | sort -u | tr '\n' ' ' || true)"
    up=0
    for node in "${NODES[@]}"; do
        case ${states} in
            *" ${node}=idle "* | *" ${node}=mix "* | *" ${node}=alloc "*) up=$((up + 1)) ;;
            *" ${node}=drain"* | *" ${node}=drng"* | *" ${node}=down "*)
                # Left over from an earlier configuration: clear it.
                timeout 10 scontrol update NodeName="${node}" State=RESUME >/dev/null 2>&1 || true ;;
        esac
    done
    [[ ${up} -eq ${NNODES} ]] && break
    sleep 1
done
read -r -a _states <<<"${states}"
states="${_states[*]}"
if [[ ${up} -ne ${NNODES} ]]; then
    log "only ${up}/${NNODES} node(s) up after ${WAIT}s (sinfo: '${states:-no answer}')"
    timeout 10 scontrol show nodes >&2 2>/dev/null || true
    show_logs
    die "cluster did not come up"
fi

# ---------------------------------------------------------------- 6. summary
version=$(sinfo --version 2>/dev/null | awk '{print $2}')
echo "slurm ${version} local cluster up: partition=${PARTITION} nodes=${NNODES} [${states}] cpus/node=${CPUS} (physical ${PHYS_CPUS}) in $((SECONDS - start_time))s"
