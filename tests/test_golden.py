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


TOOLS = ["recipe=llama3_8b", "cluster=h100", "nodes=2", "cluster.workdir=/opt/launcher", "profile.kind=nsys",
         "profile.ranks=[0,8]", "profile.step_start=5", "profile.step_end=7", "train.deterministic=true"]
"""The operator tools (issue 27): nsys wrapping the profiled ranks, deterministic mode's environment."""


@pytest.mark.parametrize("name", ["launch.sh", "rank.sh", "env.sh"])
def test_operator_tools_match_golden(name):
    texts = render_texts(compose_job(TOOLS), Path("/lustre/runs/llama3_8b-tools"))
    golden = GOLDEN / f"llama3_8b_tools.{name}"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(texts[name])
    assert texts[name] == golden.read_text()


def test_golden_tools_have_the_essentials():
    rank = (GOLDEN / "llama3_8b_tools.rank.sh").read_text()
    assert 'case " 0 8 " in' in rank and "exec nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop" \
        in rank and '--output="$BUNDLE/profile/nsys-rank${RANK}"' in rank
    assert '--no-python bash "$BUNDLE/rank.sh"' in (GOLDEN / "llama3_8b_tools.launch.sh").read_text()
    env = (GOLDEN / "llama3_8b_tools.env.sh").read_text()
    for line in ("export NCCL_ALGO=Ring", "export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0",
                 "export CUBLAS_WORKSPACE_CONFIG=:4096:8"):
        assert line in env.splitlines(), line
    assert "rank.sh" not in render_texts(compose_job(FIXED), Path("/x"))  # only with profile.kind=nsys


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


@pytest.mark.parametrize("overrides", [[], ["slurm.signal_lead_s=900"], ["slurm.time=00:10:00"]],
                         ids=["derived", "explicit-lead", "short-limit"])
def test_torchrun_waits_for_the_stop_checkpoint_as_long_as_a_stop_may_take(overrides):
    """torchrun SIGKILLs its ranks 30 s after passing Ctrl-C/SIGTERM on unless told otherwise: under load (4 CPU
    ranks at load 40-60) that killed a rank in the middle of its stop checkpoint (test_signals' Ctrl-C test, red);
    on GPUs a large model's save takes minutes. Every launch.sh gives it the signal lead, at least 300 s."""
    import re

    from launcher.core.signal_lead import FLOOR_S, lead_for_render
    from launcher.core.time_limit import time_limit_s

    for base in (FIXED, ["recipe=smoke"]):  # multi-node c10d and single-node standalone
        job = compose_job([*base, *overrides])
        text = render_texts(job, Path("/x"))["launch.sh"]
        (timeout,) = re.findall(r"^export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=(\d+)$", text, re.MULTILINE)
        assert int(timeout) >= max(FLOOR_S, lead_for_render(job, time_limit_s(job))["seconds"]), (base, overrides)


def test_an_older_torch_without_the_shutdown_flag_gets_the_timeout_as_its_close_default(monkeypatch):
    """The NGC 25.09 image's torch 2.9 has no --shutdown-timeout and ignores the variable: its signal path calls
    PContext.close(death_sig) with the default timeout; the agent sets that default from launch.sh's variable."""
    import argparse

    from torch.distributed.elastic.multiprocessing.api import PContext

    from launcher.rank.agent import SHUTDOWN_ENV, shutdown_timeout_for_older_torch

    monkeypatch.setattr(PContext.close, "__defaults__", PContext.close.__defaults__)  # restored after the test
    monkeypatch.setenv(SHUTDOWN_ENV, "420")
    shutdown_timeout_for_older_torch(argparse.Namespace(shutdown_timeout=None))  # a torch that reads it itself
    assert PContext.close.__defaults__[1] == 30
    shutdown_timeout_for_older_torch(argparse.Namespace())
    assert PContext.close.__defaults__ == (None, 420)


CHAIN = FIXED + ["post.export_hf=true", "post.eval=true"]
"""Job chains (issue 44): the training job submits post.sbatch at DONE (afterok on itself); post.sh runs the steps."""


@pytest.mark.parametrize("name", ["job.sbatch", "post.sbatch", "post.sh"])
def test_chain_matches_golden(name):
    texts = render_texts(compose_job(CHAIN), Path("/lustre/runs/llama405b-chain"))
    golden = GOLDEN / f"llama405b_chain.{name}"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(texts[name])
    assert texts[name] == golden.read_text()


def test_chain_scripts_only_with_post_steps_and_the_sbatch_submits_them_at_done():
    plain = render_texts(compose_job(FIXED), Path("/x"))
    assert not {"post.sh", "post.sbatch"} & set(plain) and "post.sbatch" not in plain["job.sbatch"]
    sbatch = (GOLDEN / "llama405b_chain.job.sbatch").read_text()
    done = sbatch.index('if [[ $status -eq 0 && -f "$BUNDLE/DONE" ]]; then')
    submit = sbatch.index('sbatch --parsable --dependency="afterok:$SLURM_JOB_ID" "$BUNDLE/post.sbatch"')
    assert done < submit < sbatch.index("  exit 0\nfi", done)  # only on the successful end, before its exit
    local = render_texts(compose_job(["post.eval=true"]), Path("/x"))  # a local run: post.sh, no post.sbatch
    assert "post.sh" in local and "post.sbatch" not in local
