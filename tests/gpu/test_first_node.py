"""GPU lane (`make test-gpu`, i.e. `python tests/gpu/lane.py`): what only a GPU node with NCCL and Transformer Engine
shows. Every test here is marked `gpu` by tests/conftest.py and skipped without CUDA (or without enough GPUs); each
job is in tests/gpu/jobs.py, which a CPU test validates and renders. Run on the first node of a cluster, in the
project's image (Dockerfile): TE, FP8, NCCL. Each job runs as a user's does: rendered by the launcher
(`action=render`), then `bash BUNDLE/launch.sh` (env.sh sourced: the job's own CUDA_DEVICE_MAX_CONNECTIONS inside
the image), under a hang detector on progress. Measurements go to the lane's report (lane.py).

What each test proves, and the CPU check of the same thing where one exists:
* TE + FP8 steps of a small Llama train (loss falls, finite) on every GPU of the node (TP2 x DP);
* TP2 x PP with FP8 and userbuffer TP overlap (so CUDA_DEVICE_MAX_CONNECTIONS=1, one hardware queue per GPU):
  interleaved, ZB-H1, ZB-H1 over VPP 2 and ZB-V do not hang and their losses equal 1F1B's within bf16/FP8
  tolerance (CPU: the p2p replay under the one-queue rule, tests/test_nccl_semantics.py; fp32 parity,
  tests/test_zero_bubble.py);
* the peak memory of every pipeline stage of those runs is within 10% of the planner's (CPU: tests/test_plan_memory_real.py);
* Megatron-FSDP trains with CUDA_DEVICE_MAX_CONNECTIONS unset and follows DDP's losses (CPU: tests/test_fsdp.py);
* EP2 with the MoE all-to-all overlap (Megatron-Core's combined 1F1B on CUDA streams) equals no overlap
  (CPU: tests/test_combined_1f1b.py with stand-in streams);
* a checkpoint saved at step 3 resumes to the uninterrupted losses;
* two pipeline stages start from different weights (CPU: tests/test_rank_seeds.py through the CPU bridge);
* the logged MFU lies within the planner's band for the job;
* each of issue 41's speed levers (TE CUDA graphs, the precision-aware optimizer, the optimizer CPU offload,
  fine-grained activation offloading) trains a small Llama like the plain run; activation offloading lowers the peak
  (CPU: the config objects, tests/test_wiring.py, tests/test_activation_offload.py; the hybrid optimizer itself,
  tests/test_optimizer_levers.py);
* a rank stopped mid-run under NCCL is named by the agent's watchdog from the other ranks' NCCL Flight Recorder
  traces, and the run stops (CPU: tests/test_hang_forensics.py with gloo's Flight Recorder).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import jobs  # noqa: E402

HANG_S = 180
"""No output for this long is a hang (a rank stuck in NCCL prints nothing): the job is killed and the test fails,
inside the lane's 15-minute budget rather than after the process group's 10-minute timeout."""
MEMORY_TOLERANCE = 0.10
"""Measured peak (max_memory_allocated) per pipeline stage against the plan, relative."""


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def need(n: int):
    if _gpus() < n:
        pytest.skip(f"needs {n} GPUs on this node, has {_gpus()}")


def record(test: str, **values) -> None:
    """One measurement for the lane's report (lane.py reads $LAUNCHER_GPU_LANE_OUT/measurements.jsonl)."""
    out = os.environ.get("LAUNCHER_GPU_LANE_OUT")
    if out:
        with open(Path(out) / "measurements.jsonl", "a") as f:
            f.write(json.dumps({"test": test, **values}) + "\n")


class Run:
    """A finished job: its bundle, stdout, and report/metrics.json (per-step metrics, final numbers)."""

    def __init__(self, bundle: Path, stdout: str):
        self.bundle, self.stdout = bundle, stdout
        report = json.loads((bundle / "report" / "metrics.json").read_text())
        self.final = report["final"]
        self.steps = {int(h["step"]): h for h in report["steps"]}

    def losses(self) -> dict:
        return {s: h["loss"] for s, h in self.steps.items()}


def run(tmp_path: Path, name: str, overrides, resume_from: Path | None = None) -> Run:
    """Render the job with the launcher and run its launch.sh on this node, as a user does; killed as hung when
    it prints nothing for HANG_S."""
    from _rank_harness import communicate_on_progress

    out = tmp_path / name
    extra = [f"checkpoint.load={resume_from}"] if resume_from else []
    rendered = subprocess.run([sys.executable, "-m", "launcher", *overrides, *extra, "action=render",
                               f"output_dir={out}", f"name={name}"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
    assert rendered.returncode == 0, f"{name}: render failed: {rendered.stderr[-2000:]}"
    bundle = next(p.parent for p in out.glob("*/launch.sh"))
    proc = subprocess.Popen(["bash", str(bundle / "launch.sh")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    stdout, stderr = communicate_on_progress(proc, HANG_S, f"{name} ({bundle})")
    logs = "".join(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}\n" for f in sorted((bundle / "logs").glob("*")))
    assert proc.returncode == 0 and "launcher: done" in stdout, f"{name} failed:\n{stdout[-3000:]}\n{stderr[-4000:]}\n{logs}"
    return Run(bundle, stdout)


def _close(a: dict, b: dict, rel: float) -> bool:
    return a.keys() == b.keys() and all(abs(a[s] - b[s]) <= rel * abs(b[s]) for s in a)


def _worst(a: dict, b: dict) -> float:
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in b if s in a)


def test_te_fp8_small_llama_trains_on_every_gpu(tmp_path):
    need(1)
    n = min(_gpus(), 8)
    losses = run(tmp_path, "fp8", jobs.fp8_llama(n)).losses()
    record("fp8_small_llama", gpus=n, first_loss=losses[1], last_loss=losses[max(losses)])
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[max(losses)] < losses[1] - 0.5, losses


@pytest.fixture(scope="module")
def tp_pipelines(tmp_path_factory):
    """Every pipeline schedule at TP2 x PP (4 or 8 GPUs), FP8, userbuffer overlap; a run that hangs fails here."""
    need(4)
    n = 8 if _gpus() >= 8 else 4
    tmp = tmp_path_factory.mktemp("tp_pipelines")
    return {kind: (run(tmp, f"tp2_{kind}", jobs.zero_bubble_tp(kind, n)), jobs.zero_bubble_tp(kind, n))
            for kind in jobs.ZB_TP_KINDS}


@pytest.mark.parametrize("kind", [k for k in jobs.ZB_TP_KINDS if k != "1f1b"])
def test_schedule_with_tp_fp8_and_userbuffers_matches_1f1b(tp_pipelines, kind):
    ref = tp_pipelines["1f1b"][0].losses()
    got = tp_pipelines[kind][0].losses()
    env = (tp_pipelines[kind][0].bundle / "env.sh").read_text()
    record(f"tp2_{kind}", worst_rel_loss_diff=_worst(got, ref), steps=len(got),
           cuda_device_max_connections="1" if "CUDA_DEVICE_MAX_CONNECTIONS=1" in env else "unset/other")
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in env  # the one-queue setting this job exists to exercise
    # same model, data and microbatches; bf16/FP8 GEMMs in another order differ in the last bits
    assert _close(got, ref, 3e-2), (kind, got, ref)


@pytest.mark.parametrize("kind", jobs.ZB_TP_KINDS)
def test_peak_memory_per_stage_within_10_percent_of_the_plan(tp_pipelines, kind):
    """The planner's per-stage total less what the caching allocator never holds (the reserve, NCCL's buffers)
    against the stage's largest max_memory_allocated (report/metrics.json ``memory_by_stage``)."""
    from launcher.config import compose_job
    from launcher.plan import plan_job

    result, overrides = tp_pipelines[kind]
    plan = plan_job(compose_job(overrides))
    rows = []
    for stage, measured in zip(plan.stages, result.final["memory_by_stage"]):
        planned = stage.total - stage.parts.get("reserve", 0) - stage.parts.get("comm_buffers", 0)
        rows.append({"stage": measured["stage"], "planned_gib": planned / 2**30, "measured_gib": measured["peak_gib"],
                     "reserved_gib": measured.get("reserved_gib")})
    record(f"memory_{kind}", stages=rows)
    assert len(rows) == len(plan.stages)
    bad = [r for r in rows if abs(r["measured_gib"] - r["planned_gib"]) > MEMORY_TOLERANCE * r["planned_gib"]]
    assert not bad, f"{kind}: stages off the plan by more than {MEMORY_TOLERANCE:.0%}: {bad}"


def test_fsdp_trains_and_follows_ddp(tmp_path):
    need(2)
    ref = run(tmp_path, "ddp", jobs.fsdp(False))
    got = run(tmp_path, "fsdp", jobs.fsdp(True))
    env = (got.bundle / "env.sh").read_text()
    record("fsdp", worst_rel_loss_diff=_worst(got.losses(), ref.losses()))
    assert "unset CUDA_DEVICE_MAX_CONNECTIONS" in env
    assert _close(got.losses(), ref.losses(), 3e-2), (got.losses(), ref.losses())


def test_moe_a2a_overlap_equals_no_overlap(tmp_path):
    need(2)
    ref = run(tmp_path, "moe", jobs.moe(False)).losses()
    got = run(tmp_path, "moe_overlap", jobs.moe(True)).losses()
    record("moe_a2a_overlap", worst_rel_loss_diff=_worst(got, ref))
    assert _close(got, ref, 2e-2), (got, ref)


def test_checkpoint_resumes_to_the_uninterrupted_losses(tmp_path):
    need(1)
    full = run(tmp_path, "full", jobs.checkpointed(1))
    step3 = sorted(full.bundle.rglob("iter_0000003"))
    assert step3, "no step-3 checkpoint written"
    resumed = run(tmp_path, "resumed", jobs.checkpointed(1), resume_from=step3[0]).losses()
    want = {s: v for s, v in full.losses().items() if s > 3}
    got = {s: v for s, v in resumed.items() if s > 3}
    record("resume", worst_rel_loss_diff=_worst(got, want))
    assert _close(got, want, 1e-2), (resumed, want)


def test_pipeline_stages_start_from_different_weights(tmp_path):
    """PP3: stages 1 and 2 draw nothing before their first layer (tests/test_rank_seeds.py says why)."""
    need(3)
    from _rank_harness import TINY

    out = tmp_path / "seeds"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", "--standalone",
           str(ROOT / "tests" / "_seed_worker.py"), str(out), *TINY, "parallel.tensor=1", "parallel.pipeline=3",
           "model.num_layers=6", "cluster.gpus_per_node=3", "cluster=h100", "precision.dtype=bf16",
           "precision.transformer_engine=true"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S * 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = sorted((json.loads(p.read_text()) for p in out.glob("rank-*.json")), key=lambda r: r["pp_rank"])
    record("stage_seeds", differ=ranks[1]["gpu_init"] != ranks[2]["gpu_init"])
    assert ranks[1]["gpu_init"] != ranks[2]["gpu_init"]


LEVER_TOLERANCE = {"cuda_graphs": 2e-2, "activation_offload": 2e-2, "precision_aware": 5e-2, "optimizer_offload": 5e-2}
"""Relative loss difference from the plain run per lever: graphs replay the eager kernels and offloading copies
tensors back bitwise (bf16 kernels may still pick another order); bf16 Adam moments and main gradients round."""


@pytest.fixture(scope="module")
def levers(tmp_path_factory):
    """Issue 41's speed levers, each alone on the small Llama on one GPU, beside the plain run."""
    need(1)
    tmp = tmp_path_factory.mktemp("levers")
    return {name: run(tmp, f"lever_{name}", jobs.lever(name)) for name in jobs.LEVERS}


def _median_step_s(r: Run) -> float:
    times = sorted(h["ms_per_step"] / 1e3 for s, h in r.steps.items() if s > 3 and "ms_per_step" in h)
    return times[len(times) // 2] if times else float("nan")


@pytest.mark.parametrize("name", [n for n in jobs.LEVERS if n != "plain"])
def test_each_speed_lever_trains_like_the_plain_run(levers, name):
    """Each lever runs on a GPU (CUDA graphs captured, TE's FusedAdam, the hybrid optimizer's host step, the offload
    manager's D2H/H2D streams) and follows the plain run's losses; its step time and peak memory against the plain
    run's go to the lane's report (ratios from one node, one run each)."""
    plain, got = levers["plain"], levers[name]
    ref, losses = plain.losses(), got.losses()
    peak = lambda r: max(s["peak_gib"] for s in r.final["memory_by_stage"])  # noqa: E731
    record(f"lever_{name}", worst_rel_loss_diff=_worst(losses, ref), step_time_ratio=_median_step_s(got)
           / _median_step_s(plain), peak_gib=peak(got), plain_peak_gib=peak(plain))
    assert all(math.isfinite(v) for v in losses.values())
    assert _close(losses, ref, LEVER_TOLERANCE[name]), (name, losses, ref)
    if name == "activation_offload":  # the attention inputs of every layer left the GPU
        assert peak(got) < peak(plain), (peak(got), peak(plain))
        assert "export NVTE_CPU_OFFLOAD_V1=1" in (got.bundle / "env.sh").read_text()


def test_logged_mfu_is_within_the_planners_band(tmp_path):
    need(1)
    from launcher.config import compose_job
    from launcher.plan import plan_job

    overrides = jobs.mfu(1)
    run_ = run(tmp_path, "mfu", overrides)
    planned = plan_job(compose_job(overrides))
    measured = sorted(h["tokens_per_s"] for s, h in run_.steps.items() if s > 2)
    median = measured[len(measured) // 2]
    predicted = planned.perf["tokens_per_s"]
    record("mfu", measured_tokens_per_s=median, planned_tokens_per_s=predicted, ratio=median / predicted,
           measured_mfu=sorted(h["mfu"] for s, h in run_.steps.items() if s > 2)[len(measured) // 2],
           planned_mfu=planned.perf["mfu"])
    # the planner is within ~3-11% on NVIDIA's published multi-node runs; a 4-layer one-GPU job has relatively
    # more embedding/loss and launch overhead than those, hence a wide band
    assert 0.6 <= median / predicted <= 1.4, (median, predicted)


def test_bench_calibrates_a_catalogue_recipe_on_one_node(tmp_path):
    """action=bench of the catalogue's Llama3-8B on this node: it runs, fits and writes the calibrated profile
    (copied into the lane's output, its record and the per-stage memory comparison into the lane's report), and
    the profile is one that plan then uses."""
    need(8)
    import re
    import shutil

    import yaml

    from _rank_harness import communicate_on_progress
    from launcher.calibration import memory_rows
    from launcher.config import compose_job

    overrides = jobs.bench(8)
    proc = subprocess.Popen([sys.executable, "-m", "launcher", *overrides, "action=bench",
                             f"output_dir={tmp_path}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    stdout, stderr = communicate_on_progress(proc, HANG_S, "bench llama3_8b")
    assert proc.returncode == 0, f"bench failed:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    path = Path(re.search(r"^calibrated profile: (\S+)$", stdout, re.M)[1])
    profile = yaml.safe_load(path.read_text())
    out = os.environ.get("LAUNCHER_GPU_LANE_OUT")
    if out:
        shutil.copy(path, Path(out) / path.name)
    metrics = json.loads((path.parent / "metrics.json").read_text())
    job = compose_job([*overrides, "name=llama3_8b-bench"])
    rows = memory_rows(job, metrics)
    record("bench_llama3_8b", profile=path.name, **{k: profile["calibrated"][k] for k in (
        "measured_step_s", "planned_step_s", "planned_with_fit_s", "fitted", "sources", "measured_passes_s")},
        memory_by_stage=rows)
    assert profile["name"] == "h100" and set(profile["calibrated"]["fitted"]) >= {"gemm_efficiency"}
    assert compose_job([*overrides, f"cluster.profile={path}"]).cluster.gemm_efficiency == \
        profile["calibrated"]["fitted"]["gemm_efficiency"]


def test_a_stopped_rank_is_named_from_the_nccl_flight_recorder_traces(tmp_path):
    """Rank n/2 (pipeline stage 1) is stopped (SIGSTOP) after step 3: its peers wait in NCCL; the watchdog (30 s
    without progress, timeouts.hang_s) signals every rank, each live one dumps its NCCL Flight Recorder trace, and
    the one line names the stopped rank from those traces; the run stops instead of waiting for the NCCL timeout."""
    import re

    from _rank_harness import communicate_on_progress, run_with_a_stopped_rank

    n = 4 if _gpus() >= 4 else 2
    need(n)
    out = tmp_path / "hang"
    rendered = subprocess.run([sys.executable, "-m", "launcher", *jobs.hang(n), "action=render", f"output_dir={out}",
                               "name=hang"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr[-2000:]
    bundle = next(p.parent for p in out.glob("*/launch.sh"))
    env = (bundle / "env.sh").read_text()
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" in env and "TORCH_FR_BUFFER_SIZE" in env, env
    victim = n // 2
    with run_with_a_stopped_rank(bundle, victim, within_s=HANG_S) as proc:
        stdout, stderr = communicate_on_progress(proc, HANG_S, "the hung run (the watchdog should stop it)")
    said = [line.removeprefix("hang watchdog: ") for line in stderr.splitlines() if line.startswith("hang watchdog: ")]
    record("hang_forensics", ranks=n, line=said[0] if said else None, exit_code=proc.returncode)
    assert proc.returncode != 0 and len(said) == 1, (proc.returncode, stdout[-2000:], stderr[-3000:])
    assert re.match(rf"hang at step \d+: rank {victim} \(host \S+, pipeline stage 1, ", said[0]), said[0]
    assert "named from the Flight Recorder traces of ranks" in said[0], said[0]
    hang = Path(said[0].rsplit("stacks: ", 1)[1].rstrip("/"))
    assert sorted(p.name for p in (hang / "fr").iterdir()) == [f"rank_{r}" for r in range(n) if r != victim]
