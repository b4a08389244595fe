"""The first check on a machine with one accelerator (world size 1, a few minutes on one H100/H200):

    python tests/gpu/one_gpu.py          # in the project's GPU image (Transformer Engine, NCCL)

The GPU lane (tests/gpu/lane.py) on one GPU: TE + FP8 steps of the small Llama, a checkpoint saved at step 3 and
resumed to the uninterrupted losses, and the logged MFU against the planner's band, with the lane's report in
./gpu-lane/. Multi-GPU checks (pipelines under NCCL with TP and FP8, FSDP, EP with the all-to-all overlap, stage
seeds) need `make test-gpu` on a node with 4-8 GPUs: NCCL refuses two ranks on one device. Exit code: the lane's.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lane  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(lane.main(["--gpus", "1", *sys.argv[1:]]))
