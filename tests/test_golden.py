"""The llama405b sbatch (and its torchrun launch script) are compared against golden files.

Regenerate after an intended template change with: UPDATE_GOLDEN=1 pytest tests/test_golden.py
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import ROOT
from launcher.config import compose_job
from launcher.render import render_texts

GOLDEN = ROOT / "tests" / "golden"
FIXED = ["recipe=llama405b", "cluster=h200", "nodes=64", "cluster.workdir=/opt/launcher",
         "cluster.partition=batch", "cluster.account=llm"]


@pytest.mark.parametrize("name", ["job.sbatch", "launch.sh", "env.sh"])
def test_llama405b_matches_golden(name):
    texts = render_texts(compose_job(FIXED), Path("/lustre/runs/llama405b-golden"))
    golden = GOLDEN / f"llama405b.{name}"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(texts[name])
    assert texts[name] == golden.read_text()


def test_golden_sbatch_has_the_essentials():
    text = (GOLDEN / "llama405b.job.sbatch").read_text()
    for needle in ("#SBATCH --nodes=64", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=1",
                   "#SBATCH --signal=B:USR1@", "#SBATCH --requeue", "srun ", "scontrol requeue",
                   "MASTER_ADDR=", "#SBATCH --partition=batch", "#SBATCH --account=llm"):
        assert needle in text, needle
    launch = (GOLDEN / "llama405b.launch.sh").read_text()
    assert "--rdzv-backend=c10d" in launch and "--nproc-per-node=8" in launch and "--nnodes=64" in launch
    env = (GOLDEN / "llama405b.env.sh").read_text()
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in env
