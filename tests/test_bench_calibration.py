"""action=bench and calibrated cluster profiles (launcher/calibration.py): the fit, the file, and plan using it.

No duration is asserted: a measured step time is whatever this machine gave; what is checked is that the fitted
term is the one the plan then uses and that it moves the plan onto the measurement."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from launcher.calibration import (FITTED_FIELDS, ProfileError, calibrated_profile, fit_gemm_efficiency,
                                  measured_step_s, planned_step_s, read_profile, write_profile)
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
    assert set(FITTED_FIELDS) == {"gemm_efficiency"}


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
    job = compose_job([*TINY, f"cluster.profile={path}"])
    assert job.cluster.gemm_efficiency == fitted  # the plan's term is the file's
    measured = record["measured_step_s"]
    before, after = planned_step_s(compose_job(TINY)), planned_step_s(job)
    assert abs(after - measured) < abs(before - measured)  # calibration moves the plan toward the measurement
    assert after == pytest.approx(record["planned_with_fit_s"], rel=1e-4)
    code, out, _ = cli(*TINY, f"cluster.profile={path}", "action=plan")
    assert code == 0 and f"calibrated profile in use: {path} (gemm_efficiency {fitted:.4g}" in out
    code, out, _ = cli(*TINY, f"cluster.profile={path}", "action=search")
    assert code == 0 and f"calibrated profile in use: {path}" in out


@pytest.mark.multirank
def test_bench_on_a_slurm_cluster_says_where_to_run_it(cli, tmp_path):
    code, out, err = cli("recipe=llama3_8b", "cluster=h100", "action=bench", f"output_dir={tmp_path}")
    assert code == 2 and list(tmp_path.iterdir()) == []
    [line] = err.splitlines()
    assert line.startswith("error: action='bench': ") and line.endswith("try cluster.launcher=local action=bench on "
                                                                        "the cluster's first node (same profile)")
