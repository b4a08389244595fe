"""action=bench and calibrated cluster profiles (launcher/calibration.py): the fit, the file, and plan using it.

No duration is asserted: a measured step time is whatever this machine gave; what is checked is that the fitted
term is the one the plan then uses and that it moves the plan onto the measurement."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from launcher.calibration import (FITTED_FIELDS, ProfileError, calibrated_profile, fit_gemm_efficiency, fit_passes,
                                  fit_profile, measured_passes, measured_step_s, planned_step_s, read_profile,
                                  write_profile)
from launcher.config import compose_job

TINY = ["recipe=smoke", "cluster.gpus_per_node=1", "parallel.tensor=1", "parallel.pipeline=1",
        "train.global_batch_size=4"]
"""One CPU rank, two microbatches of 2 x 256 tokens: the smallest real run of the embedded default."""


def test_fit_puts_the_plan_on_the_measured_step():
    job = compose_job(["recipe=smoke"])
    before = planned_step_s(job)
    eff, bounded = fit_gemm_efficiency(job, 3 * before)
    assert not bounded and eff < job.cluster.gemm_efficiency
    assert planned_step_s(job, eff=eff) == pytest.approx(3 * before, rel=1e-4)


def test_fit_stops_at_the_bounds():
    job = compose_job(["recipe=smoke"])
    assert fit_gemm_efficiency(job, 1e-9) == (1.0, True)  # faster than the plan at the whole peak


def test_measured_step_is_the_median_after_warm_up():
    metrics = {"steps": [{"ms_per_step": ms} for ms in (900, 500, 400, 100, 120, 110, 300)]}
    assert measured_step_s(metrics) == pytest.approx(0.115)


def test_a_written_profile_is_what_compose_applies(tmp_path):
    job = compose_job(["recipe=smoke"])
    path = write_profile(tmp_path / "p.yaml", calibrated_profile(job, {"gemm_efficiency": 0.123}, {"job": "x"}))
    assert list(tmp_path.iterdir()) == [path]  # atomic: no temporary file left beside it
    assert read_profile(str(path), job.cluster)["calibrated"]["fitted"] == {"gemm_efficiency": 0.123}
    calibrated = compose_job(["recipe=smoke", f"cluster.profile={path}"])
    assert calibrated.cluster.gemm_efficiency == 0.123
    assert planned_step_s(calibrated) == pytest.approx(planned_step_s(job, eff=0.123))
    assert set(FITTED_FIELDS) == {"gemm_efficiency", "op_overhead_us", "compute_units_per_node"}


def _passes_at(job, **cluster):
    """What the planner says each stage's passes take with these cluster terms: the measurement a bench run
    would record if the planner were exact."""
    import dataclasses

    from launcher.core import derive
    from launcher.plan.timing import stage_costs

    job = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, **cluster))
    lay = derive(job)
    return {st: {"f": c.f, "bw": c.b + c.w} for st in range(lay.pp) for c in [stage_costs(job, lay, st)]}


def test_the_op_cost_is_added_per_op_of_each_layer_pass():
    from launcher.core import derive
    from launcher.plan.host import HOST_OPS
    from launcher.plan.timing import stage_costs

    job = compose_job(["recipe=smoke"])
    lay = derive(job)
    plain = stage_costs(job, lay, 0)
    costly = stage_costs(compose_job(["recipe=smoke", "cluster.op_overhead_us=100"]), lay, 0)
    layers = 2  # the smoke model's 4 layers over PP2
    ops_f = HOST_OPS["attn"][0] + HOST_OPS["mlp"][0]
    ops_b = HOST_OPS["attn"][1] + HOST_OPS["mlp"][1]
    assert costly.f - plain.f == pytest.approx(layers * ops_f * 100e-6)
    assert costly.b - plain.b == pytest.approx(layers * ops_b * 100e-6)
    assert costly.w == plain.w


def test_ranks_sharing_compute_units_wait_for_each_others_work():
    from launcher.plan.timing import step_time

    dp4 = ["recipe=smoke", "parallel.tensor=1", "parallel.pipeline=1"]
    alone = step_time(compose_job(dp4))
    shared = step_time(compose_job([*dp4, "cluster.compute_units_per_node=1"]))
    # four equal ranks on one unit: four times the pipeline part; the optimizer and DP terms unchanged
    assert shared.pipeline_s == pytest.approx(4 * alone.pipeline_s)
    assert shared.step_s - shared.pipeline_s == pytest.approx(alone.step_s - alone.pipeline_s)
    roomy = step_time(compose_job([*dp4, "cluster.compute_units_per_node=8"]))
    assert roomy.step_s == pytest.approx(alone.step_s)  # more units than ranks: the ranks' own time


def test_the_passes_fit_recovers_the_terms_that_made_them():
    job = compose_job(["recipe=smoke"])
    eff, per_op, rms = fit_passes(job, _passes_at(job, gemm_efficiency=0.05, op_overhead_us=180.0))
    assert eff == pytest.approx(0.05, rel=1e-6) and per_op == pytest.approx(180.0, rel=1e-6) and rms < 1e-9
    eff, per_op, _ = fit_passes(job, _passes_at(job, gemm_efficiency=0.3, op_overhead_us=0.0))
    assert eff == pytest.approx(0.3, rel=1e-6) and per_op == pytest.approx(0.0, abs=1e-6)


def test_on_cpu_the_shared_units_put_the_plan_on_the_measured_step():
    job = compose_job(["recipe=smoke"])
    passes = {**_passes_at(job, gemm_efficiency=0.05, op_overhead_us=180.0), "cpu": True}
    fitted, sources, bounded = fit_profile(job, 5.0, passes)
    assert set(fitted) == {"gemm_efficiency", "op_overhead_us", "compute_units_per_node"} and not bounded
    calibrated = compose_job(["recipe=smoke", *(f"cluster.{k}={v}" for k, v in fitted.items())])
    assert planned_step_s(calibrated) == pytest.approx(5.0, rel=1e-4)
    assert "least squares over 4 per-stage pass times (CPU seconds" in sources["op_overhead_us"]
    # without passes (an interleaved run records none) only the GEMM efficiency is fitted, to the step
    fitted, sources, _ = fit_profile(job, 5.0, None)
    assert set(fitted) == {"gemm_efficiency"} and "no per-stage passes" in sources["gemm_efficiency"]


def test_measured_passes_are_cpu_seconds_per_microbatch_after_warm_up():
    def step(f_wall, f_cpu, bw_cpu):  # one rank's step: two microbatches' F and BW
        spans = [["F", 0, 0, 0.0, f_wall], ["BW", 0, 0, 1.0, 2.0], ["F", 1, 0, 2.0, 2.0 + f_wall],
                 ["BW", 1, 0, 3.0, 4.0]]
        return spans, [f_cpu, bw_cpu, f_cpu, bw_cpu]

    def rank(pp, values):
        steps = [step(*v) for v in values]
        return {"pp": pp, "steps": [s for s, _ in steps], "cpu_steps": [c for _, c in steps]}

    spans = {"ranks": [rank(0, [(9, 9, 9)] * 3 + [(5, 0.1, 0.2), (5, 0.3, 0.4)]),
                       rank(1, [(9, 9, 9)] * 3 + [(5, 0.5, 0.6)] * 2)]}
    passes = measured_passes(spans)
    assert passes[0] == pytest.approx({"f": 0.2, "bw": 0.3}) and passes[1] == pytest.approx({"f": 0.5, "bw": 0.6})
    spans["ranks"][0]["steps"][4][1][2] = 1  # a second model chunk: the planner's per-stage costs do not apply
    assert measured_passes(spans) is None


@pytest.mark.parametrize("key,value,rule", [("op_overhead_us", -5, "microseconds in [0, 1e6]"),
                                            ("compute_units_per_node", 0, "a number of compute units in (0, 1e6]")])
def test_a_fitted_term_out_of_its_range_is_refused(tmp_path, key, value, rule):
    job = compose_job(["recipe=smoke"])
    path = write_profile(tmp_path / "p.yaml", calibrated_profile(job, {key: value}, {}))
    with pytest.raises(ProfileError, match=rf"its fitted {key}={value} is not {re.escape(rule)}"):
        read_profile(str(path), job.cluster)


def test_another_gpu_kind_is_refused(tmp_path):
    h100 = compose_job(["recipe=llama3_8b", "cluster=h100"])
    path = write_profile(tmp_path / "h.yaml", calibrated_profile(h100, {"gemm_efficiency": 0.5}, {}))
    with pytest.raises(ProfileError, match=r"calibrated on cluster h100 \(gpu H100\); this job runs on cluster local"):
        read_profile(str(path), compose_job(["recipe=smoke"]).cluster)


@pytest.mark.multirank
def test_bench_writes_a_profile_that_plan_then_uses(cli, tmp_path):
    code, out, err = cli(*TINY, "action=bench", f"output_dir={tmp_path}")
    assert code == 0, err[-2000:]
    path = re.search(r"^calibrated profile: (\S+)$", out, re.M)[1]
    bundle = re.search(r"^bundle: (\S+)$", out, re.M)[1]
    assert path.startswith(bundle) and path.endswith("/report/calibrated-local.yaml")
    profile = yaml.safe_load(open(path))
    record = profile["calibrated"]
    metrics = json.load(open(f"{bundle}/report/metrics.json"))
    assert record["measured_step_s"] == pytest.approx(measured_step_s(metrics), rel=1e-5)
    assert len(metrics["steps"]) == record["steps"] == 8
    fitted = record["fitted"]["gemm_efficiency"]
    assert profile["gemm_efficiency"] == fitted and profile["name"] == "local" and profile["gpu"] == "cpu"
    # the run recorded its passes (CPU seconds): op cost and shared cores fitted beside the efficiency
    assert set(record["fitted"]) == {"gemm_efficiency", "op_overhead_us", "compute_units_per_node"}
    assert set(record["measured_passes_s"][0]) == {"f", "bw"}
    job = compose_job([*TINY, f"cluster.profile={path}"])
    assert job.cluster.gemm_efficiency == fitted  # the plan's terms are the file's
    assert job.cluster.compute_units_per_node == record["fitted"]["compute_units_per_node"]
    measured = record["measured_step_s"]
    before, after = planned_step_s(compose_job(TINY)), planned_step_s(job)
    assert abs(after - measured) < abs(before - measured)  # calibration moves the plan toward the measurement
    assert after == pytest.approx(record["planned_with_fit_s"], rel=1e-4)
    code, out, _ = cli(*TINY, f"cluster.profile={path}", "action=plan")
    assert code == 0 and f"calibrated profile in use: {path} (gemm_efficiency {fitted:.4g}, op_overhead_us" in out
    code, out, _ = cli(*TINY, f"cluster.profile={path}", "action=search")
    assert code == 0 and f"calibrated profile in use: {path}" in out


@pytest.mark.multirank
def test_bench_on_a_slurm_cluster_says_where_to_run_it(cli, tmp_path):
    code, out, err = cli("recipe=llama3_8b", "cluster=h100", "action=bench", f"output_dir={tmp_path}")
    assert code == 2 and list(tmp_path.iterdir()) == []
    [line] = err.splitlines()
    assert line.startswith("error: action='bench': ") and line.endswith("try cluster.launcher=local action=bench on "
                                                                        "the cluster's first node (same profile)")


@pytest.mark.parametrize("shown,how", [(0, "no nvidia-smi on this machine"), (4, "nvidia-smi -L")])
def test_bench_of_a_layout_this_machine_cannot_hold_is_one_line(cli, tmp_path, monkeypatch, shown, how):
    import launcher.calibration as calibration

    monkeypatch.setattr(calibration, "visible_gpus", lambda: (shown, how))
    code, out, err = cli("recipe=llama3_8b", "cluster.launcher=local", "action=bench", f"output_dir={tmp_path}")
    assert code == 2 and list(tmp_path.iterdir()) == []  # refused before any bundle
    [line] = err.splitlines()
    assert line.startswith("error: action='bench': the job's layout (TP1 PP1 CP2 DP4) runs 8 ranks, one per GPU, "
                           f"and this machine shows {shown} ({how}); try action=bench on a node with 8 GPUs")
    assert line.endswith("with parallel.* to match") == bool(shown)


def test_visible_gpus_count_only_what_cuda_visible_devices_leaves(monkeypatch, tmp_path):
    import launcher.calibration as calibration

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nfor i in 0 1 2 3 4 5 6 7; do echo \"GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)\"; done\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert calibration.visible_gpus() == (8, "nvidia-smi -L")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert calibration.visible_gpus()[0] == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert calibration.visible_gpus()[0] == 0


def test_bench_compares_static_bytes_per_stage_with_the_plan():
    from launcher.calibration import memory_rows
    from launcher.plan.memory import stage_params, static_bytes

    job = compose_job(["recipe=smoke"])
    planned = [sum(v for k, v in static_bytes(job, stage_params(job, st)).items()
                   if k in ("weights", "grads", "optimizer")) for st in (0, 1)]
    metrics = {"final": {"memory_by_stage": [
        {"stage": 0, "peak_gib": 0.5, "basis": "peak RSS",
         "static_bytes": {"weights": planned[0] / 4, "grads": planned[0] / 4, "optimizer": planned[0] / 2 * 1.005}},
        {"stage": 1, "peak_gib": 0.5, "basis": "peak RSS",
         "static_bytes": {"weights": planned[1] / 4, "grads": planned[1] / 4, "optimizer": planned[1] / 2 * 1.05}}]}}
    rows = memory_rows(job, metrics)
    assert [r["static_planned_bytes"] for r in rows] == pytest.approx(planned)
    assert [r["static_within_tolerance"] for r in rows] == [True, False]  # 0.25% off, then 2.4% off
