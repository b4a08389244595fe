#!/bin/bash
# Rendered by the launcher for run llama405b: the steps after training (export_hf + eval) for every kept
# checkpoint, in one process (launcher/hf/post.py); results beside each checkpoint, the chain's state in post.json.
set -euo pipefail
BUNDLE=/lustre/runs/llama405b-chain
cd /opt/launcher
source "$BUNDLE/env.sh"
# Not a process of the training run: runs, status, cancel and the run's cleanup find training by LAUNCHER_BUNDLE.
unset LAUNCHER_BUNDLE
exec python -m launcher post "$BUNDLE"
