"""Training options end to end on one CPU process: LR schedules (Megatron's OptimizerParamScheduler),
time-limited stop with checkpoint, checkpoint.dir / keep_last, and offline wandb."""
from __future__ import annotations

import types

import pytest

from launcher.schema import TrainConfig
from _rank_harness import TINY, layout, train


def _lrs(**kw):
    from launcher.rank.optim import build_scheduler

    opt = types.SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": 0.0}])
    sched = build_scheduler(opt, train=TrainConfig(lr=1.0, min_lr=0.1, **kw), steps=100)
    out = []
    for _ in range(100):
        out.append(opt.param_groups[0]["lr"])
        sched.step(1)
    return out


def test_lr_schedules():
    cos = _lrs(lr_schedule="cosine", warmup_steps=10)
    assert cos[0] == 0.0 and cos[5] == pytest.approx(0.5) and cos[10] == pytest.approx(1.0)
    assert cos[55] == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-6) and cos[99] == pytest.approx(0.1, abs=1e-3)
    lin = _lrs(lr_schedule="linear", warmup_steps=0)
    assert lin[0] == 1.0 and lin[50] == pytest.approx(0.55) and lin[99] == pytest.approx(0.109, abs=1e-6)
    assert set(_lrs(lr_schedule="constant", warmup_steps=0)) == {1.0}
    wsd = _lrs(lr_schedule="wsd", warmup_steps=5, wsd_decay_steps=20)
    assert wsd[10] == wsd[79] == 1.0 and wsd[90] < 1.0 and wsd[99] == pytest.approx(0.1, abs=0.05)
    with pytest.raises(ValueError, match="train.lr_schedule='step'"):
        _lrs(lr_schedule="step")


def test_time_limit_stops_with_checkpoint_and_keep_last(tmp_path):
    ckpt = tmp_path / "ckpts"
    run = train(tmp_path, "stop", 1, TINY + layout() + [
        "train.train_steps=50", "train.exit_after_minutes=0.0001", f"checkpoint.dir={ckpt}"])
    assert run.final["status"] == "stopped" and sorted(run.steps) == [1]
    assert (ckpt / "latest").read_text().strip() == "iter_0000001"

    run = train(tmp_path, "keep", 1, TINY + layout() + [
        "train.train_steps=4", "checkpoint.save_interval=1", "checkpoint.keep_last=2",
        f"checkpoint.dir={tmp_path / 'keep_ckpts'}"])
    assert sorted(p.name for p in (tmp_path / "keep_ckpts").glob("iter_*")) == ["iter_0000003", "iter_0000004"]
    assert run.final["status"] == "done"


def test_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = train(tmp_path, "wb", 1, TINY + layout() + ["train.train_steps=2", "logging.wandb_project=unit",
                                                      "logging.wandb_mode=offline"])
    runs = list((run.bundle / "wandb").glob("offline-run-*"))
    assert runs and list(runs[0].glob("*.wandb")), "offline run files"


def test_stop_file_checkpoints_and_exits_then_resume_writes_done(tmp_path):
    """The Slurm job script's contract: a STOP file in the bundle stops training cleanly with a checkpoint
    (no DONE, so the job is requeued); the requeued run resumes and writes DONE when finished."""
    from _rank_harness import Run, run_train, write_bundle

    bundle = write_bundle(tmp_path / "b", TINY + layout() + ["train.train_steps=3"])
    (bundle / "STOP").touch()
    proc = run_train(bundle, 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = Run(bundle, proc)
    assert first.final["status"] == "stopped" and sorted(first.steps) == [1]
    assert (bundle / "checkpoints" / "latest").read_text().strip() == "iter_0000001"
    assert not (bundle / "DONE").exists()

    (bundle / "STOP").unlink()  # what the job script does before the requeued run
    proc = run_train(bundle, 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and sorted(Run(bundle, proc).steps) == [2, 3]
    assert (bundle / "DONE").read_text().strip() == "3"
