"""The loss-spike rule (issue 39, launcher/rank/spikes.py): a planted spike is rolled back to the last checkpoint,
replayed bitwise, and skipped when it reproduces (a poisoned batch) or let go when it does not (a one-time fault);
every later resume gives the losses of the uninterrupted run with the skip.

The spike is planted by tests/_crash_site (LAUNCHER_TEST_SPIKE_AT_STEP): the last stage's final norm turned over
and scaled 20-fold for that step's forward and backward, put back bitwise after it. Every run here is 2 ranks (DP2):
the verdict is a world reduction, the suspect an all-gather. Losses are compared bitwise: same machine, same
kernels, the same path as the bitwise resume tests."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from _rank_harness import ROOT, TINY, Run, layout, rank_log_tails, run_train, write_bundle

SITE = str(ROOT / "tests" / "_crash_site")
RULE = ["train.spike_factor=1.5", "train.spike_window=4"]
JOB = TINY + layout() + ["train.train_steps=12", "checkpoint.save_interval=4", "data.num_workers=0"]
AT = 9  # the planted step: checkpoints at 4 and 8 before it


def _env(once: bool = False) -> dict:
    return {"PYTHONPATH": os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH", "")) if p),
            "LAUNCHER_TEST_SPIKE_AT_STEP": str(AT), "LAUNCHER_TEST_SPIKE_ONCE": "1" if once else "0"}


def _run(tmp: Path, name: str, overrides, env=None) -> Run:
    bundle = write_bundle(tmp / name, overrides, 2)
    proc = run_train(bundle, 2, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{rank_log_tails(bundle)}"
    return Run(bundle, proc)


def _events(ckpt: Path) -> list:
    return json.loads((ckpt / "spikes.json").read_text())["events"]


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    """The uninterrupted run with a poisoned batch at step 9: spiked, rolled back to iter 8, replayed, skipped."""
    return _run(tmp_path_factory.mktemp("spikes"), "poisoned", JOB + RULE, _env())


def test_a_reproduced_spike_is_rolled_back_replayed_and_skipped(poisoned):
    out, ckpt = poisoned.stdout, poisoned.bundle / "checkpoints"
    assert f"warning: loss spike at step {AT}: loss " in out
    assert "rolled back to " + str(ckpt / "iter_0000008") + " (step 8, 64 samples consumed): replaying" in out
    assert f"warning: loss spike at step {AT} reproduced on replay" in out and "(samples 64-71) is skipped" in out
    [event] = _events(ckpt)
    assert event["step"] == AT and event["consumed"] == 64 and event["skipped"] is True
    assert event["replayed_loss"] == event["loss"]  # the replay met the same batch, bitwise the same loss
    manifest = json.loads((ckpt / "iter_0000012" / "launcher.json").read_text())
    assert manifest["spikes"]["skipped"] == [[AT, 64]] and len(manifest["spikes"]["window"]) == 4
    assert max(poisoned.steps) == 12 and poisoned.steps[12]["loss"] < 8  # trained on after the skip


def test_a_resume_from_before_the_spike_skips_it_from_the_history(poisoned, tmp_path):
    """iter 4 with the run's history: step 9's skip is known, no rollback; steps 5-12 are the uninterrupted run's."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(poisoned.bundle / "checkpoints" / "iter_0000004", ckpt / "iter_0000004")
    shutil.copy(poisoned.bundle / "checkpoints" / "spikes.json", ckpt / "spikes.json")
    resumed = _run(tmp_path, "resumed", JOB + RULE + [f"checkpoint.dir={ckpt}"], _env())
    assert "resumed from" in resumed.stdout and "rolled back" not in resumed.stdout
    assert {s: resumed.losses()[s] for s in range(5, 13)} == {s: poisoned.losses()[s] for s in range(5, 13)}
    assert json.loads((ckpt / "iter_0000012" / "launcher.json").read_text())["spikes"]["skipped"] == [[AT, 64]]


def test_a_load_of_a_checkpoint_without_the_history_finds_and_skips_it_again(poisoned, tmp_path):
    """checkpoint.load of iter 8 into a new directory: no history there; the rule finds the spike again, rolls back
    to the loaded checkpoint (the new directory has none of its own yet) and skips it: the same losses."""
    resumed = _run(tmp_path, "loaded", JOB + RULE + [f"checkpoint.load={poisoned.bundle / 'checkpoints' / 'iter_0000008'}"],
                   _env())
    assert "rolled back to " + str(poisoned.bundle / "checkpoints" / "iter_0000008") in resumed.stdout
    assert {s: resumed.losses()[s] for s in range(9, 13)} == {s: poisoned.losses()[s] for s in range(9, 13)}


def test_a_spike_that_does_not_reproduce_is_let_go_and_training_is_unchanged(tmp_path):
    """A one-time fault: replayed, not met again; every loss is the clean run's (which has no rule at all), the
    record says so and names the rank whose own loss changed."""
    clean = _run(tmp_path, "clean", JOB)
    faulty = _run(tmp_path, "faulty", JOB + RULE, _env(once=True))
    assert f"warning: loss spike at step {AT} did not reproduce on replay" in faulty.stdout
    assert "a transient hardware fault is the likely cause: rank " in faulty.stdout
    assert faulty.losses() == clean.losses()
    [event] = _events(faulty.bundle / "checkpoints")
    assert event["skipped"] is False and event["verdict"].startswith("not reproduced")
    assert event["suspect"]["rank"] in (0, 1) and event["suspect"]["host"]
    assert event["replayed_loss"] == clean.losses()[AT] != event["loss"]


# ---- bad input -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,field", [
    (["train.spike_factor=1", "checkpoint.save_interval=50"], "train.spike_factor"),
    (["train.spike_factor=0.5", "checkpoint.save_interval=50"], "train.spike_factor"),
    (["train.spike_factor=3", "train.spike_window=100", "checkpoint.save_interval=50"], "train.spike_window"),
    (["train.spike_factor=3", "checkpoint.save_interval=0"], "checkpoint.save_interval"),
    (["train.spike_factor=3", "checkpoint.save_interval=50", "train.spike_window=1"], "train.spike_window"),
])
def test_a_spike_rule_that_cannot_work_is_one_line_with_a_working_alternative(overrides, field, cli):
    code, out, err = cli("recipe=smoke", *overrides, "action=validate")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and errors[0].startswith(f"error: {field}="), err
    alternative = errors[0].rsplit("; try ", 1)[1].split(" or ")[0].split()
    code, out, err = cli("recipe=smoke", *overrides, *alternative, "action=validate")
    assert code == 0, err


def test_after_a_skipped_spike_the_learning_rate_is_lowered_for_the_stated_steps(poisoned, tmp_path):
    lowered = _run(tmp_path, "lowered", JOB + RULE + ["train.spike_lr_factor=0.5", "train.spike_lr_steps=2"], _env())
    assert "the learning rate runs at 0.5x for 2 steps" in lowered.stdout
    for step in (10, 11):  # the skipped step's two successors, at half the scheduler's rate
        assert lowered.steps[step]["lr"] == pytest.approx(0.5 * poisoned.steps[step]["lr"], rel=1e-12)
    assert lowered.steps[12]["lr"] == poisoned.steps[12]["lr"]  # the scheduler's own rate again
    assert lowered.losses()[10] == poisoned.losses()[10] != lowered.losses()[11]  # step 10's update was smaller


def test_the_lowered_rate_covers_the_steps_after_each_skip_only():
    from types import SimpleNamespace

    from launcher.rank.spikes import SpikeGuard

    train = SimpleNamespace(spike_factor=2.0, spike_window=4, spike_lr_factor=0.25, spike_lr_steps=2,
                            global_batch_size=8)
    guard = SpikeGuard(train, Path("/nonexistent-spikes-dir"), "1f1b", print)
    guard.skips = {9: 64}
    assert [guard.lr_scale(s) for s in range(8, 14)] == [1.0, 1.0, 0.25, 0.25, 1.0, 1.0]
