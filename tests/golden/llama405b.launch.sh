#!/bin/bash
# Rendered by the launcher for run llama405b: starts one torchrun on this node (8 ranks).
set -euo pipefail
BUNDLE=/lustre/runs/llama405b-golden
cd /opt/launcher
source "$BUNDLE/env.sh"
# Multi-node: every node's torchrun meets at the c10d store on the first node (MASTER_ADDR from job.sbatch).
exec python -m torch.distributed.run \
  --nnodes=64 \
  --nproc-per-node=8 \
  --rdzv-backend=c10d \
  --rdzv-endpoint="${MASTER_ADDR}:${MASTER_PORT}" \
  --rdzv-id="${SLURM_JOB_ID:-llama405b}" \
  --max-restarts=0 \
  -m launcher.rank --bundle "$BUNDLE"

