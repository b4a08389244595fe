"""The first check on a machine with one accelerator (world size 1, a few minutes on one H100/H200):

    python tests/gpu/one_gpu.py          # in the project's GPU image (Transformer Engine, NCCL)

Runs the single-GPU part of the GPU lane (tests/gpu/test_first_node.py): TE + FP8 steps of the small Llama,
a checkpoint saved at step 3 and resumed to the uninterrupted losses, and the logged MFU against the planner's
band. Multi-GPU checks (pipelines under NCCL, EP with the all-to-all overlap, stage seeds) need `make test-gpu`
on a node with 2-8 GPUs: NCCL refuses two ranks on one device. Exit code: pytest's (0 = all passed); 2 with a
one-line reason when this machine cannot run the lane (no CUDA, no megatron-core, no Transformer Engine).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device visible (torch.cuda.is_available() is False)"
    for module, why in (("megatron.core", "megatron-core (pip install --no-deps megatron-core==0.19.2)"),
                        ("transformer_engine", "Transformer Engine (the project's GPU image has it: Dockerfile)")):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return f"{why} is not importable"
    return None


def main() -> int:
    reason = missing()
    if reason:
        print(f"one_gpu: cannot run the GPU lane here: {reason}", file=sys.stderr)
        return 2
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/gpu/test_first_node.py",
           "-k", "fp8_small_llama or checkpoint_resumes or mfu"]
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
