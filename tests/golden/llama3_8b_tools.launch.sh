#!/bin/bash
# Rendered by the launcher for run llama3_8b: starts one torchrun on this node (8 ranks).
set -euo pipefail
BUNDLE=/lustre/runs/llama3_8b-tools
cd /opt/launcher
source "$BUNDLE/env.sh"
# Markers of an earlier run of this bundle must not end this one: a stale STOP would stop it after one step.
# (Under job.sbatch, the batch shell has cleared STOP itself and may set it again on USR1 from now on.)
if [[ -z "${LAUNCHER_STOP_CLEARED:-}" ]]; then rm -f "$BUNDLE/STOP"; fi
rm -f "$BUNDLE/STOPPED" "$BUNDLE/FAILED" "$BUNDLE/DONE" "$BUNDLE/HANG_NODE"
# The no-progress rule (launcher/rank/progress.py) compares the attempts of one launch: this one's torchrun
# restarts, or every requeue of one Slurm job. Running the bundle again (a new job, a new local run) starts afresh.
export LAUNCHER_LAUNCH_ID="${SLURM_JOB_ID:+slurm-$SLURM_JOB_ID}"
if [[ -z "$LAUNCHER_LAUNCH_ID" ]]; then LAUNCHER_LAUNCH_ID="local-$$-$(date +%s)"; fi
# torchrun restarts every rank of this node up to 3 time(s) after one dies (cluster.max_restarts);
# each restart resumes from the newest complete checkpoint. After passing on a stop signal it waits this long
# (the signal lead, at least 300 s; not its 30 s) for the ranks' stop checkpoint before it kills them. An
# environment variable, not --shutdown-timeout: older torch (the NGC 25.09 image's) has no such flag (launcher.rank.agent applies it).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300
status=0
# Multi-node: every node's torchrun meets at the c10d store on the first node (MASTER_ADDR from job.sbatch).
python -m launcher.rank.agent \
  --nnodes=2 \
  --nproc-per-node=8 \
  --rdzv-backend=c10d \
  --rdzv-endpoint="${MASTER_ADDR}:${MASTER_PORT}" \
  --rdzv-id="${SLURM_JOB_ID:-llama3_8b}" \
  --max-restarts=3 \
  --no-python bash "$BUNDLE/rank.sh" || status=$?  # profile.kind=nsys: the profiled ranks under nsys

# The final line: done, stopped (and why), or failed. A signal (Ctrl-C 130, SIGTERM 143, SIGHUP 129) that the
# ranks answered with a checkpoint keeps its exit code: the run stopped, it did not fail.
if [[ $status -eq 0 && -f "$BUNDLE/DONE" ]]; then
  echo "launcher: done: trained to step $(head -c 20 "$BUNDLE/DONE" | tr -d '\n') (DONE)"
elif [[ ( $status -eq 0 || $status -eq 129 || $status -eq 130 || $status -eq 143 ) && -f "$BUNDLE/STOPPED" ]]; then
  echo "launcher: stopped $(head -c 300 "$BUNDLE/STOPPED"); checkpointed, run again (or requeue) to resume"
elif [[ $status -eq 129 || $status -eq 130 || $status -eq 143 ]]; then
  echo "launcher: interrupted (exit $status) before a step boundary; nothing was checkpointed since the last save"
elif [[ -f "$BUNDLE/FAILED" ]]; then
  echo "launcher: failed: $(head -c 500 "$BUNDLE/FAILED")"
  [[ $status -ne 0 ]] || status=1
else
  echo "launcher: failed (torchrun exit $status); see $BUNDLE/logs/rank-*.log"
  [[ $status -ne 0 ]] || status=1
fi
exit "$status"
