"""plan_job / search / oom_message for every recipe and cluster: fast, JSON-able, honest, torch-free."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config import compose_job
from launcher.plan import Plan, PlanError, oom_message, plan_job
from launcher.plan.search import search

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted(p.stem for p in (ROOT / "recipes" / "recipe").glob("*.yaml"))
CLUSTERS = [None, "h100", "h200"]


def _compose(recipe, cluster, *extra):
    return compose_job([f"recipe={recipe}", *([f"cluster={cluster}"] if cluster else []), *extra])


@pytest.fixture(scope="module", autouse=True)
def warm():
    plan_job(compose_job(["recipe=smoke"]))  # first-call imports are not the planner's cost


# An H200 variant (recipes/recipe/*_h200.yaml) differs from its base only in cluster and layout fields: the
# search space on another cluster is its base's, already searched there; it is planned and searched on its own.
# A recipe that names its own cluster (``override /cluster: h100``) composes the same job with and without it: that
# pair is searched once (CI budget: the duplicates were ~60 worker-seconds).
OWN_CLUSTER = {r: m[1] for r in RECIPES
               if (m := re.search(r"override /cluster: (\w+)", (ROOT / "recipes" / "recipe" / f"{r}.yaml").read_text()))}
CASES = [(r, c) for r in RECIPES for c in CLUSTERS
         if c is None or (not r.endswith("_h200") and c != OWN_CLUSTER.get(r))]


@pytest.mark.parametrize("recipe,cluster", CASES, ids=[f"{r}-{c}" for r, c in CASES])
def test_plan_and_search_every_recipe(recipe, cluster):
    job = _compose(recipe, cluster)
    # (how fast plan and search are is benchmarks/planner_speed.py's business, as a ratio against a reference
    # measured in the same run: CPU-time guards here failed on busy 2-core machines, issue 25)
    plan = plan_job(job)
    assert isinstance(plan, Plan)
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["gflops_per_token"] > 0 and len(data["stages"]) == job.parallel.pipeline
    assert 0 < plan.perf["mfu"] < 1 and plan.step.step_s > 0
    assert "GFLOP/token" in plan.text()
    found = search(job, top=5)
    assert found, "search found no layout that fits"
    assert all(c.peak_gb <= c.gpu_memory_gb for c in found)
    assert [c.tokens_per_s for c in found] == sorted((c.tokens_per_s for c in found), reverse=True)
    assert all(c.why and c.overrides for c in found)
    json.dumps([c.to_dict() for c in found])


def test_search_results_compose_back_into_jobs_that_fit():
    job = compose_job(["recipe=llama3_70b", "cluster=h100"])
    best = search(job, top=3)
    for cand in best:
        again = plan_job(compose_job(["recipe=llama3_70b", "cluster=h100", *cand.overrides]))
        assert again.fits
        assert again.perf["tokens_per_s"] == pytest.approx(cand.tokens_per_s, rel=1e-6)


def test_llama405b_on_few_nodes_is_refused():
    job = compose_job(["recipe=llama405b", "cluster=h100", "nodes=8", "parallel.context=1"])
    plan = plan_job(job)
    assert not plan.fits
    msg = oom_message(plan)
    assert "out of memory" in msg and "stage 0" in msg and "largest contributors" in msg
    assert plan.peak_gb > job.cluster.gpu_memory_gb
    assert not search(job)  # nothing fits 405B on 64 H100s


def test_oom_message_when_it_fits():
    assert "fits" in oom_message(plan_job(compose_job(["recipe=smoke"])))


def test_invalid_layout_is_not_planned():
    with pytest.raises(PlanError, match="parallel.tensor"):
        plan_job(compose_job(["recipe=llama3_70b", "parallel.tensor=3"]))


def test_moe_models_plan_and_search():
    for model in ("deepseek_v3", "qwen3_30b_a3b", "qwen3_235b_a22b"):
        job = compose_job(["recipe=llama405b", f"model={model}", "cluster=h200", "nodes=8", "parallel.first_stage_layers=null",
                           "parallel.last_stage_layers=null", "parallel.pipeline=1", "parallel.context=1",
                           "parallel.expert=8", "parallel.tensor=1", "parallel.sequence_parallel=false",
                           "parallel.tp_comm_overlap=false"])
        plan = plan_job(job)
        assert plan.params["expert"] > plan.params["dense"]
        search(job, top=3)  # completes (its speed: benchmarks/planner_speed.py)


def test_login_node_code_never_imports_torch():
    code = (
        "import sys\n"
        "from launcher.config import compose_job\n"
        "from launcher.plan import plan_job, oom_message\n"
        "from launcher.plan.search import search\n"
        "from launcher.plan.simulator import simulate_kind\n"
        "for r in ('smoke', 'llama3_8b', 'llama3_70b', 'llama405b'):\n"
        "    j = compose_job(['recipe=' + r, 'cluster=h100'])\n"
        "    p = plan_job(j); oom_message(p); p.text(); search(j, top=2)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'transformer_engine')]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_plan_writes_nothing_where_it_was_not_asked_to(tmp_path):
    """`action=plan` of a pipelined job from an empty directory leaves it empty (the default output_dir, `runs`, is
    relative to it: a plan must not create it) and says how to get the schedule pictures; with output_dir given it
    writes them there, and only there, and names them."""
    empty, elsewhere = tmp_path / "empty", tmp_path / "pictures"
    empty.mkdir()
    cmd = [sys.executable, "-m", "launcher", "recipe=llama3_70b", "action=plan"]
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=empty, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "schedule pictures: not written; add output_dir=DIR to write llama3_70b-schedules.png" in proc.stdout
    assert list(empty.iterdir()) == []
    proc = subprocess.run(cmd + [f"output_dir={elsewhere}"], cwd=empty, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert list(empty.iterdir()) == []
    written = sorted(p.name for p in elsewhere.iterdir())
    assert "llama3_70b-schedules.trace.json" in written and not [n for n in written if n.endswith(".tmp")]
    assert f"schedule picture: {elsewhere / 'llama3_70b-schedules.trace.json'}" in proc.stdout
    proc = subprocess.run(cmd + ["--json"], cwd=empty, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and json.loads(proc.stdout)["tokens_per_s"] > 0 and list(empty.iterdir()) == []
