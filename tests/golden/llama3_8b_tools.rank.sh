#!/bin/bash
# Rendered by the launcher for run llama3_8b (profile.kind=nsys): torchrun starts this once per rank instead of the
# rank entry itself. The ranks in profile.ranks (0 8) run under Nsight Systems, which records only
# between their cudaProfilerStart at step 5 and cudaProfilerStop before step 7
# (--capture-range=cudaProfilerApi); one report per profiled rank: $BUNDLE/profile/nsys-rank<N>.nsys-rep.
# On Slurm, nsys must be on the compute nodes' PATH (or in cluster.container_image).
set -euo pipefail
BUNDLE=/lustre/runs/llama3_8b-tools
case " 0 8 " in
  *" ${RANK} "*)
    mkdir -p "$BUNDLE/profile"
    exec nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop \
      --trace=cuda,nvtx,osrt,cudnn,cublas --sample=none --cpuctxsw=none --force-overwrite=true \
      --output="$BUNDLE/profile/nsys-rank${RANK}" \
      python -u -m launcher.rank --bundle "$BUNDLE" ;;
esac
exec python -u -m launcher.rank --bundle "$BUNDLE"
