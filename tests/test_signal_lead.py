"""Stopping in time for a Slurm time limit (launcher/core/signal_lead.py): the arithmetic of the --signal lead
derived at render time from measured save times, and the ranks' own stop guard on every (re)start."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.config import compose_job
from launcher.core import signal_lead as sl
from launcher.core.checkpoint import directory as cd
from launcher.render import RenderError, signal_lead_of, write_bundle


def manifest(ckpt: Path, step: int, seconds, *, complete: bool = True) -> Path:
    path = ckpt / f"iter_{step:07d}"
    path.mkdir(parents=True)
    if complete:
        (path / "launcher.json").write_text(json.dumps({"step": step, "files": {}, "save_seconds": seconds}))
    return path


def test_needed_is_factor_times_save_plus_a_step_plus_margin():
    assert sl.needed_s(40, 3, factor=2, margin_s=60) == 143
    assert sl.needed_s(-1, -1, factor=2, margin_s=60) == 60  # nothing measured: the margin alone


def test_derived_lead_has_the_old_default_as_floor_capped_at_a_quarter_of_the_limit():
    assert sl.derived_lead_s(limit_s=14400, save_s=1, step_s=1, factor=2, margin_s=60) == 300
    assert sl.derived_lead_s(limit_s=14400, save_s=200, step_s=5.2, factor=2, margin_s=60) == 466  # ceil(465.2)
    assert sl.derived_lead_s(limit_s=600, save_s=1, step_s=1, factor=2, margin_s=60) == 150  # 600 / 4


def test_measured_save_is_the_newest_complete_checkpoints(tmp_path):
    assert cd.measured_save_s(tmp_path / "none") is None
    manifest(tmp_path, 10, 12.5)
    manifest(tmp_path, 20, None)                      # complete but recorded no save time: skipped
    manifest(tmp_path, 30, 99.0, complete=False)      # no manifest: not a checkpoint
    (tmp_path / "iter_0000040.tmp").mkdir()           # a save in progress
    assert cd.measured_save_s(tmp_path) == (12.5, tmp_path / "iter_0000010")
    manifest(tmp_path, 50, 80.0)
    assert cd.measured_save_s(tmp_path) == (80.0, tmp_path / "iter_0000050")


PLAN = {"params": {"total": 70e9}, "step": {"step_s": 4.0}}


def test_render_lead_explicit_measured_or_estimated(tmp_path):
    job = compose_job(["recipe=llama3_70b", "nodes=8"])
    # estimate: 70e9 x 14 bytes over 8 nodes x 1 GB/s = 122.5 s; 2 x 122.5 + 4 + 60 = 309
    lead = sl.lead_for_render(job, 14400, PLAN, tmp_path)
    assert lead["seconds"] == 309 and lead["estimated_save_s"] == 122.5 and lead["measured_save_s"] is None
    manifest(tmp_path, 100, 400.0)  # this run's last save, measured: it wins over the bandwidth guess
    lead = sl.lead_for_render(job, 14400, PLAN, tmp_path)
    assert lead["seconds"] == 2 * 400 + 4 + 60 and lead["measured_in"] == str(tmp_path / "iter_0000100")
    manifest(tmp_path, 200, 10.0)   # faster now: back to the floor
    assert sl.lead_for_render(job, 14400, PLAN, tmp_path)["seconds"] == 300
    job = compose_job(["recipe=llama3_70b", "nodes=8", "slurm.signal_lead_s=120"])
    assert sl.lead_for_render(job, 14400, PLAN, tmp_path) == {"seconds": 120,
                                                              "source": "slurm.signal_lead_s (explicit)"}


def test_rendered_sbatch_uses_the_measured_lead_and_records_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    manifest(ckpt, 8, 150.0)
    job = compose_job(["recipe=smoke", f"checkpoint.dir={ckpt}", f"output_dir={tmp_path / 'runs'}",
                       "slurm.signal_margin_s=30"])
    bundle = write_bundle(job, argv=[], plan={"params": {"total": 1e6}, "step": {"step_s": 0.5}})
    text = bundle.sbatch.read_text()
    assert "#SBATCH --signal=B:USR1@331\n" in text  # ceil(2 x 150 + 0.5 + 30)
    assert "export LAUNCHER_SIGNAL_LEAD_S=331\n" in text and "LAUNCHER_JOB_END=" in text
    meta = json.loads((bundle.path / "meta.json").read_text())["signal_lead"]
    assert meta["seconds"] == 331 and meta["measured_save_s"] == 150.0


def test_a_derived_lead_longer_than_the_time_limit_is_refused_with_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    manifest(ckpt, 8, 3000.0)
    job = compose_job(["recipe=smoke", f"checkpoint.dir={ckpt}", "slurm.time=01:00:00"])
    with pytest.raises(RenderError) as err:
        signal_lead_of(job, None)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("slurm.time='01:00:00': too short to stop in time") and \
           "measured in" in msg and "; try slurm.time=04:00:00 or an explicit slurm.signal_lead_s" in msg, msg  # 2 x (6060 + 60) s, in hours
    fixed = compose_job(["recipe=smoke", f"checkpoint.dir={ckpt}", "slurm.time=04:00:00"])
    assert signal_lead_of(fixed, None)["seconds"] == 6060


def test_job_end_from_the_environment():
    assert sl.job_end_from_env({}) is None
    assert sl.job_end_from_env({sl.JOB_END_ENV: ""}) is None
    assert sl.job_end_from_env({sl.JOB_END_ENV: "garbage"}) is None
    assert sl.job_end_from_env({sl.JOB_END_ENV: "1764590400"}) == 1764590400.0


def test_stop_guard_uses_its_latest_save_and_slowest_recent_step():
    now = [1000.0]
    guard = sl.StopGuard(1000.0 + 200, save_s=10, factor=2, margin_s=60, clock=lambda: now[0])
    assert guard.reason() is None                    # 200 s left, needs 2 x 10 + 0 + 60 = 80
    guard.step_took(5.0)
    guard.step_took(1.0)
    assert guard.needed() == 85                      # the slowest recent step counts
    guard.saved(80.0)                                # saves got slower since render: needs 2 x 80 + 5 + 60
    reason = guard.reason()
    assert reason == ("the Slurm time limit is 200 s away, less than 2 x the last save (80.0 s) + a step "
                      "(5.0 s) + 60 s"), reason
    guard.saved(1.0)
    assert guard.reason() is None                    # 200 > 2 + 5 + 60
    now[0] = 1000.0 + 140                            # 60 s left
    assert guard.reason() is not None
    assert sl.StopGuard(None, save_s=1e9, factor=2, margin_s=60).reason() is None  # not under Slurm
