#!/usr/bin/env bash
# Stop the local SLURM test cluster started by slurm/setup_local_cluster.sh.
#
#   sudo bash slurm/teardown_local_cluster.sh           # stop slurmd(s), slurmctld, munged
#   sudo bash slurm/teardown_local_cluster.sh --purge   # ... and delete job state, spool
#                                                       #     dirs, logs and slurm.conf
#
# Only the daemons named in the pid files written by the setup script are
# stopped (/run/slurmd-*.pid, /run/slurmctld.pid, /run/munge/munged.pid).
# Packages and the munge key are kept, so setup runs again in seconds.
# Safe to run when nothing is running.
set -euo pipefail

log() { printf 'teardown_local_cluster: %s\n' "$*" >&2; }

purge=0
case ${1:-} in
    "") ;;
    --purge) purge=1 ;;
    *) log "usage: $0 [--purge]"; exit 2 ;;
esac

if [[ ${EUID} -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then
        exec sudo -E bash "$0" "$@"
    fi
    log "ERROR: must run as root"; exit 1
fi

pid_alive() {  # pidfile name
    local pidfile=$1 name=$2 pid
    [[ -s ${pidfile} ]] || return 1
    pid=$(<"${pidfile}")
    [[ ${pid} =~ ^[0-9]+$ ]] || return 1
    [[ -r /proc/${pid}/comm ]] || return 1
    [[ $(<"/proc/${pid}/comm") == "${name}" ]]
}

stopped=()
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
            log "${name} (pid ${pid}) ignored SIGTERM; sending SIGKILL"
            kill -KILL "${pid}" 2>/dev/null || true
        fi
        stopped+=("${name}:${pid}")
    fi
    rm -f "${pidfile}"
}

if pid_alive /run/slurmctld.pid slurmctld && command -v squeue >/dev/null 2>&1; then
    jobs_now=$(timeout 10 squeue -h -o '%i %T %j' 2>/dev/null | tr '\n' ';' || true)
    [[ -n ${jobs_now} ]] && log "WARNING: jobs still queued/running are lost: ${jobs_now}"
fi

# Compute daemons first, then the controller, then munge.
for pf in /run/slurmd-*.pid /run/slurmd.pid; do
    [[ -e ${pf} ]] && stop_pid "${pf}" slurmd
done
stop_pid /run/slurmctld.pid slurmctld
stop_pid /run/munge/munged.pid munged

if [[ ${purge} -eq 1 ]]; then
    rm -rf /var/lib/slurm/slurmctld /var/lib/slurm/slurmd-* /var/log/slurm/slurmctld.log \
        /var/log/slurm/slurmd-*.log /etc/slurm/slurm.conf
    log "purged slurm state, spool, logs and /etc/slurm/slurm.conf"
fi

# Report (never kill) leftovers that were not started through our pid files.
leftover=""
if command -v pgrep >/dev/null 2>&1; then
    for name in slurmd slurmctld munged; do
        leftover+=$(pgrep -x -l "${name}" | tr '\n' ' ' || true)
    done
fi
[[ -n ${leftover} ]] && log "WARNING: still running (not started by setup_local_cluster.sh?): ${leftover}"

echo "local slurm cluster stopped: ${stopped[*]:-nothing was running}"
