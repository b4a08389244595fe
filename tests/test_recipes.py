"""Every recipe composes, validates, plans and renders, with no GPU and no network."""
from __future__ import annotations

import subprocess

import pytest

from conftest import RECIPES, ROOT
from launcher.config import compose_job, load_job
from launcher.problems import errors
from launcher.render import cross_check, render_texts
from launcher.validate import validate

CLUSTERS = sorted(p.stem for p in (ROOT / "recipes" / "cluster").glob("*.yaml"))


def test_there_are_recipes_and_clusters():
    assert {"smoke", "llama3_8b", "llama3_70b", "llama405b"} <= set(RECIPES)
    assert {"local", "h100", "h200"} <= set(CLUSTERS)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_validates_and_renders(recipe, tmp_path):
    job = compose_job([f"recipe={recipe}"])
    assert errors(validate(job)) == []
    texts = render_texts(job, tmp_path / "bundle")
    assert cross_check(job, texts) == []
    for name in ("job.sbatch", "launch.sh", "env.sh"):
        script = tmp_path / name
        script.write_text(texts[name])
        syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr
    (tmp_path / "config.yaml").write_text(texts["config.yaml"])
    assert load_job(tmp_path / "config.yaml") == job  # the bundle's config round-trips exactly


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "smoke"])
@pytest.mark.parametrize("cluster", ["h100", "h200"])
def test_gpu_recipes_validate_on_both_hopper_profiles(recipe, cluster):
    job = compose_job([f"recipe={recipe}", f"cluster={cluster}"])
    assert errors(validate(job)) == []
    # CUDA_DEVICE_MAX_CONNECTIONS is derived per job (launcher/core/cuda_env.py; tests/test_cuda_env.py)
    assert job.cluster.backend == "nccl" and job.cluster.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "auto"


@pytest.mark.parametrize("recipe", RECIPES)
def test_cli_renders_a_bundle_for_every_recipe(recipe, cli, tmp_path):
    code, out, err = cli(f"recipe={recipe}", "action=render", f"output_dir={tmp_path}")
    assert code == 0, err
    bundles = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert len(bundles) == 1
    bundle = bundles[0]
    for name in ("config.yaml", "job.sbatch", "launch.sh", "env.sh", "meta.json", "plan.json"):
        assert (bundle / name).is_file(), name
    assert (bundle / "logs").is_dir()
    assert f"bundle: {bundle}" in out
    assert load_job(bundle / "config.yaml").name == recipe


def test_llama405b_recipe_is_the_published_shape():
    job = compose_job(["recipe=llama405b"])
    m, p = job.model, job.parallel
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups) == \
        (126, 16384, 53248, 128, 8)
    assert m.rope_scaling and m.vocab_size == 128256
    assert job.nodes * job.cluster.gpus_per_node == p.tensor * p.pipeline * p.context * 4


def test_experiment_and_data_group_overrides():
    job = compose_job(["recipe=llama3_8b", "+experiment=bf16"])
    assert job.precision.fp8 is None
    job = compose_job(["data=mock"])
    assert job.data.kind == "mock" and job.name == "smoke"
    job = compose_job(["recipe=llama3_70b", "+experiment=tiny", "nodes=2"])
    assert job.model.hidden_size == 128 and job.model.num_layers == 80 and job.nodes == 2
