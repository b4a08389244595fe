"""CUDA_DEVICE_MAX_CONNECTIONS in the rendered bundle follows each job (launcher/core/cuda_env.py), as Megatron-LM
0.19 requires: 1 for TP/CP before Blackwell (arguments.py asserts it), more than 1 for the MoE all-to-all overlap
(megatron/core/transformer/moe/README.md; 32 in Megatron-LM's Slurm guide), unset with Megatron-FSDP (arguments.py
refuses 1). A profile no longer forces 1 on every job: under 1 the a2a overlap overlaps nothing."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from launcher.config import compose_job
from launcher.render import render_texts
from launcher.validate import errors, validate

VAR = "CUDA_DEVICE_MAX_CONNECTIONS"


def _rendered(*overrides) -> tuple:
    job = compose_job(list(overrides))
    texts = render_texts(job, Path("/lustre/runs/x"))
    values = re.findall(rf"^export {VAR}=(\S+)$", texts["env.sh"], re.M)
    assert len(values) <= 1, texts["env.sh"]
    return job, texts, values[0] if values else None


@pytest.mark.parametrize("recipe", ["deepseek_v3", "deepseek_v3_h200", "qwen3_235b_a22b"])
def test_a2a_overlap_recipes_get_more_than_one_connection(recipe):
    job, texts, value = _rendered(f"recipe={recipe}", "cluster=h200")
    assert job.parallel.moe_a2a_overlap and job.parallel.expert > 1
    assert value == "32"
    assert 'source "$BUNDLE/env.sh"' in texts["launch.sh"] and "launch.sh" in texts["job.sbatch"]
    assert not [e for e in errors(validate(job)) if e.field.startswith("cluster.env")]


def test_plain_tensor_parallel_job_gets_one_and_the_same_job_without_overlap_too():
    job, _, value = _rendered("recipe=llama405b", "cluster=h200")
    assert job.parallel.tensor > 1 and not job.parallel.moe_a2a_overlap and value == "1"
    # the a2a recipe with its overlap switched off is an ordinary TP/EP job again: 1
    job, _, value = _rendered("recipe=deepseek_v3", "cluster=h200", "parallel.moe_a2a_overlap=false")
    assert (job.parallel.tensor > 1 or job.parallel.context > 1) == (value == "1")


def test_fsdp_blackwell_and_single_gpu_layouts_leave_it_unset():
    job, _, value = _rendered("recipe=llama3_8b", "cluster=h100", "parallel.context=1", "parallel.tensor=1",
                              "parallel.megatron_fsdp=true")
    assert value is None
    assert not [e for e in errors(validate(job)) if e.field.startswith("cluster.env")]
    _, _, value = _rendered("recipe=llama405b", "cluster=h200", "cluster.gpu=B200")
    assert value is None  # "requirement no longer exists since the Blackwell architecture"
    _, _, value = _rendered("recipe=llama3_8b", "cluster=h100", "parallel.context=1", "parallel.tensor=1")
    assert value is None


def test_an_explicit_value_wins_and_is_still_validated():
    _, _, value = _rendered("recipe=deepseek_v3", "cluster=h200", f"cluster.env.{VAR}=1")
    assert value == "1"  # Megatron-LM allows 1 (prioritise TP) with the overlap and TP > 1: kept, not refused
    job = compose_job(["recipe=llama405b", "cluster=h200", f"cluster.env.{VAR}=8"])
    assert any(e.field == f"cluster.env.{VAR}" for e in errors(validate(job)))
    job = compose_job(["recipe=llama3_8b", "cluster=h100", "parallel.context=1", "parallel.megatron_fsdp=true",
                       f"cluster.env.{VAR}=1"])
    assert any(e.field == f"cluster.env.{VAR}" and "Megatron-FSDP" in e.rule for e in errors(validate(job)))


IMAGE_ENV = {VAR: "1", "PYTHONUNBUFFERED": "1", "NCCL_DEBUG": "WARN"}
"""What a container image (an NGC PyTorch base; ours until it stopped) or the submitting shell already exports."""


@pytest.mark.parametrize("overrides,expected", [
    (["recipe=llama3_8b", "cluster=h100", "parallel.context=1", "parallel.tensor=1", "parallel.megatron_fsdp=true"],
     None),
    (["recipe=deepseek_v3", "cluster=h200"], "32"),
    (["recipe=llama405b", "cluster=h200"], "1"),
    (["recipe=llama405b", "cluster=h200", "cluster.gpu=B200"], None),
], ids=["fsdp", "moe_a2a_overlap", "tp", "blackwell"])
def test_the_ranks_get_the_derived_value_inside_an_image_that_sets_one(tmp_path, overrides, expected):
    """env.sh sourced by bash in an environment that already has CUDA_DEVICE_MAX_CONNECTIONS=1 (the image's ENV)
    leaves exactly the job's derived value: unset for Megatron-FSDP and Blackwell, 32 with the all-to-all
    overlap, 1 for TP before Blackwell. The rest of the image's environment is kept."""
    import os
    import subprocess

    _, texts, _ = _rendered(*overrides)
    (tmp_path / "env.sh").write_text(texts["env.sh"])
    script = f'source "{tmp_path / "env.sh"}"; echo "${{{VAR}-<unset>}}"; echo "$NCCL_DEBUG"'
    env = {k: v for k, v in os.environ.items() if k != VAR} | IMAGE_ENV
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == [expected or "<unset>", "WARN"], (texts["env.sh"], out)


def test_the_image_does_not_set_it_for_every_job():
    from launcher import ROOT

    assert not re.search(rf"^\s*(ENV\s+)?{VAR}=", (ROOT / "Dockerfile").read_text(), re.M)
