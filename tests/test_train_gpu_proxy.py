"""benchmarks/gpu_proxy.py runs end to end at a tiny size on CPU (the H200 run uses the same code path,
only sizes, dtype and NCCL differ), and its TFLOP/s follow from tokens/s and the Megatron FLOPs formula."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _rank_harness import ROOT


# What the H200 image lacks (it has torch, numpy, packaging, triton): importing any of these must not be needed.
ABSENT_ON_H200 = ["hydra", "omegaconf", "wandb", "tensorboard", "pydantic", "yaml", "psutil", "xxhash", "click",
                  "jinja2", "tokenizers", "matplotlib", "einops", "transformer_engine", "apex"]


def test_gpu_proxy_tiny_on_cpu_without_extra_packages():
    code = (f"import sys, runpy\nfor m in {ABSENT_ON_H200!r}: sys.modules[m] = None  # import -> ImportError\n"
            "sys.argv = ['gpu_proxy', '--tiny']\nrunpy.run_path('benchmarks/gpu_proxy.py', run_name='__main__')\n")
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert result["device"] == "cpu" and result["dtype"] == "bf16"
    assert result["tokens_per_s"] > 0 and 0 < result["peak_memory_gib"] < 8
    assert result["tflops"] == pytest.approx(result["gflop_per_token"] * result["tokens_per_s"] / 1e3, rel=1e-6)
    assert result["mfu"] == pytest.approx(result["tflops"] / 989.0, rel=1e-9)
    assert result["last_loss"] < result["first_loss"]  # bf16 Megatron optimizer path really trains
