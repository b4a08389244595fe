#!/bin/bash
# Stop the one-node Slurm cluster started by slurm/localhost/start.sh: slurmd, slurmctld, then munged, each by
# the PID in its PID file (never by name). Jobs still running are cancelled first. Config and state are kept,
# so start.sh brings the same cluster back.
#
#   bash slurm/localhost/stop.sh                   # all three
#   bash slurm/localhost/stop.sh slurmd slurmctld  # only these (the test suite stops only what it started)
set -uo pipefail
STATE_DIR=${SLURM_LOCAL_DIR:-/var/lib/slurm-localhost}
log() { echo "slurm-localhost: $*"; }

stop_pid() {  # stop_pid PIDFILE COMM
  local pid
  [[ -s $1 ]] || return 0
  pid=$(cat "$1" 2>/dev/null)
  if [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]]; then
    log "stopping $2 (pid $pid)"
    kill "$pid" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then log "$2 (pid $pid) ignored SIGTERM for 10 s; SIGKILL"; kill -9 "$pid" 2>/dev/null; fi
  fi
  rm -f "$1"
}

WHICH=" ${*:-slurmd slurmctld munged} "
for d in $WHICH; do
  [[ $d =~ ^(slurmd|slurmctld|munged)$ ]] || { echo "slurm-localhost: error: unknown daemon '$d' (slurmd, slurmctld, munged)" >&2; exit 2; }
done
if [[ $WHICH == *" slurmctld "* || $WHICH == *" slurmd "* ]] && command -v squeue >/dev/null \
   && scontrol ping 2>/dev/null | grep -q 'is UP'; then
  jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')
  if [[ -n ${jobs// } ]]; then log "cancelling jobs: $jobs"; scancel $jobs 2>/dev/null; sleep 1; fi
fi
[[ $WHICH == *" slurmd "* ]] && stop_pid "$STATE_DIR/slurmd.pid" slurmd
[[ $WHICH == *" slurmctld "* ]] && stop_pid "$STATE_DIR/slurmctld.pid" slurmctld
[[ $WHICH == *" munged "* ]] && stop_pid /run/munge/munged.pid munged
log "stopped:$WHICH"
