#!/bin/bash
# Start a real one-node Slurm cluster on this machine (munge + slurmctld + slurmd), for the end-to-end tests
# in tests/test_slurm_localhost.py. Idempotent: installs Debian's packages only if missing, (re)writes the
# config only if it changed, starts only the daemons that are not running, then waits until the node is up.
#
#   bash slurm/localhost/start.sh      # as root, on Debian 12, with or without systemd
#   bash slurm/localhost/stop.sh       # stops the daemons again (by PID)
#
# The node advertises SLURM_LOCAL_CPUS CPUs (default: max(4, nproc)) through SlurmdParameters=config_overrides,
# so 4-process CPU jobs fit on a 2-core machine. Credentials expire after 10 s (AuthInfo cred_expire) so that a
# requeued job starts again within seconds rather than ~2 minutes. Without slurmdbd there is no sacct: follow
# jobs with `scontrol show job`. Everything (state, spool, logs, PID files) lives under $SLURM_LOCAL_DIR;
# the config is written to /etc/slurm/slurm.conf, where sbatch/srun/sinfo look by default.
set -euo pipefail

T0=$(date +%s.%N)
STATE_DIR=${SLURM_LOCAL_DIR:-/var/lib/slurm-localhost}
CONF=/etc/slurm/slurm.conf
WAIT_S=${SLURM_LOCAL_WAIT_S:-90}
log() { echo "slurm-localhost: $*"; }
die() { echo "slurm-localhost: error: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "run as root (installs packages, starts munged/slurmctld/slurmd)"

# --- 1. packages -------------------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  log "installing slurmctld slurmd slurm-client munge (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  pkgs=(slurmctld slurmd slurm-client munge)
  if ! apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/tmp/slurm-localhost-apt.log 2>&1; then
    apt-get update -qq >>/tmp/slurm-localhost-apt.log 2>&1 || true
    apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >>/tmp/slurm-localhost-apt.log 2>&1 \
      || { tail -20 /tmp/slurm-localhost-apt.log >&2; die "apt-get install failed (log: /tmp/slurm-localhost-apt.log)"; }
  fi
fi

# A PID file whose process is alive and is the expected program.
alive() {  # alive PIDFILE COMM
  local pid
  [[ -s $1 ]] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]]
}

# --- 2. munge ----------------------------------------------------------------------------------------------
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
  log "creating /etc/munge/munge.key"
  if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key --force
  else dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; fi
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
MUNGE_PID=/run/munge/munged.pid
if ! alive "$MUNGE_PID" munged; then
  log "starting munged"
  rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
  runuser -u munge -- /usr/sbin/munged --pid-file="$MUNGE_PID" 2>&1 || die "munged did not start"
fi
for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
munge -n | unmunge >/dev/null 2>&1 || die "munge does not work (munge -n | unmunge)"

# --- 3. config ---------------------------------------------------------------------------------------------
NODE=$(hostname -s)
# job.sbatch sets MASTER_ADDR to the node's Slurm name (scontrol show hostnames): it must resolve.
if ! getent hosts "$NODE" >/dev/null; then
  log "adding '127.0.0.1 $NODE' to /etc/hosts (the node name must resolve for torchrun's rendezvous)"
  echo "127.0.0.1 $NODE" >>/etc/hosts
fi
NPROC=$(nproc)
CPUS=${SLURM_LOCAL_CPUS:-$(( NPROC > 4 ? NPROC : 4 ))}
# RealMemory must not exceed what slurmd detects, or the node drains.
MEM=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -n1)
MEM=${MEM:-1000}
install -d -m 0755 /etc/slurm "$STATE_DIR" "$STATE_DIR/ctld" "$STATE_DIR/spool" "$STATE_DIR/log"
NEW_CONF=$(cat <<CONF
# Written by slurm/localhost/start.sh: a one-node test cluster on this machine. Re-run start.sh rather than edit.
ClusterName=localhost
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2,sched_interval=5
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
KillWait=5
InactiveLimit=0
StateSaveLocation=${STATE_DIR}/ctld
SlurmdSpoolDir=${STATE_DIR}/spool
SlurmctldPidFile=${STATE_DIR}/slurmctld.pid
SlurmdPidFile=${STATE_DIR}/slurmd.pid
SlurmctldLogFile=${STATE_DIR}/log/slurmctld.log
SlurmdLogFile=${STATE_DIR}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=${NODE} NodeAddr=127.0.0.1 CPUs=${CPUS} Boards=1 SocketsPerBoard=1 CoresPerSocket=${CPUS} ThreadsPerCore=1 RealMemory=${MEM} State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
)
# Notes: SlurmUser=root keeps a throwaway cluster simple. bf_interval/sched_interval make a requeued job start
# again within seconds of its BeginTime (cred_expire + 1 s) instead of at the next 30 s backfill pass.
# MinJobAge keeps finished jobs visible to `scontrol show job` for 10 minutes. ReturnToService=2 brings the
# node back after an unclean stop.
CHANGED=0
if [[ ! -f $CONF ]] || [[ "$(cat "$CONF")" != "$NEW_CONF" ]]; then
  [[ -f $CONF ]] && ! grep -q '^# Written by slurm/localhost/start.sh' "$CONF" && cp "$CONF" "$CONF.orig.$(date +%s)"
  printf '%s\n' "$NEW_CONF" >"$CONF"
  CHANGED=1
  log "wrote $CONF (node $NODE, $CPUS CPUs, RealMemory=$MEM)"
fi

# --- 4. daemons --------------------------------------------------------------------------------------------
CTLD_PID=$STATE_DIR/slurmctld.pid
SLURMD_PID=$STATE_DIR/slurmd.pid
stop_pid() {  # stop_pid PIDFILE COMM
  alive "$1" "$2" || return 0
  local pid; pid=$(cat "$1"); kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}
if (( CHANGED )); then  # daemons running with an older config: restart them (cred_expire needs a restart)
  stop_pid "$SLURMD_PID" slurmd
  stop_pid "$CTLD_PID" slurmctld
fi
if ! alive "$CTLD_PID" slurmctld; then
  log "starting slurmctld"
  /usr/sbin/slurmctld -f "$CONF" || die "slurmctld did not start (log: $STATE_DIR/log/slurmctld.log)"
fi
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.2; done
scontrol ping 2>/dev/null | grep -q 'is UP' || die "slurmctld does not answer (log: $STATE_DIR/log/slurmctld.log)"
if ! alive "$SLURMD_PID" slurmd; then
  log "starting slurmd"
  /usr/sbin/slurmd -f "$CONF" || die "slurmd did not start (log: $STATE_DIR/log/slurmd.log)"
fi

# --- 5. wait for the node -------------------------------------------------------------------------------
state=""
deadline=$(( $(date +%s) + WAIT_S ))
while (( $(date +%s) < deadline )); do
  state=$(sinfo -h -N -n "$NODE" -o '%t' 2>/dev/null | head -n1 || true)
  case $state in
    idle|mix|alloc|comp) break ;;
    down*|drain*|drng*|fail*)  # e.g. left down by an earlier unclean stop: bring it back
      scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true ;;
  esac
  sleep 0.5
done
case $state in
  idle|mix|alloc|comp) ;;
  *) sinfo -N -l >&2 || true; die "node $NODE is '${state:-unknown}' after ${WAIT_S} s (logs: $STATE_DIR/log/)" ;;
esac
ELAPSED=$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
log "node $NODE is $state ($CPUS CPUs) after $ELAPSED s; config $CONF, logs $STATE_DIR/log/"
