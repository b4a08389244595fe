"""Resharding through dist_checkpointing: a checkpoint saved at one layout continues at another (named with
checkpoint.load=, since a layout change makes it another run's checkpoint) with the original run's losses."""
from __future__ import annotations

import pytest

from _rank_harness import TINY, Run, layout, run_train, train, write_bundle

STEPS, K = 6, 3


def _continues_on_one_process(where, overrides, saved, full: Run) -> None:
    """One process loads ``saved`` (step K) by checkpoint.load= and trains steps K+1.. with ``full``'s losses."""
    bundle = write_bundle(where, overrides + [f"checkpoint.load={saved}"], 1)
    proc = run_train(bundle, 1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resumed from {saved} at step {K}" in proc.stdout
    resumed = Run(bundle, proc)
    assert sorted(resumed.steps) == list(range(K + 1, STEPS + 1))
    for step in resumed.steps:
        assert resumed.losses()[step] == pytest.approx(full.losses()[step], rel=1e-5), step


def test_tp2pp2_checkpoint_continues_on_one_process_with_the_same_losses(tmp_path, reference_run):
    overrides = TINY + [f"train.train_steps={STEPS}", f"checkpoint.save_interval={K}"]
    # the uninterrupted TP2 x PP2 run of test_train_resume (its final checkpoint aside), trained once
    full = reference_run(4, overrides + layout(tp=2, pp=2) + ["checkpoint.save_at_end=true"])
    saved = full.bundle / "checkpoints" / f"iter_{K:07d}"

    _continues_on_one_process(tmp_path / "tp1pp1", overrides + layout(), saved, full)


def test_distributed_optimizer_state_reshards_across_a_dp_change_with_fully_reshardable(tmp_path, reference_run):
    """DP2 -> DP1 with the distributed optimizer: fully_reshardable continues with the DP2 run's losses
    (measured: same size on disk, saves ~0.4 s vs 0.03 s for dp_reshardable on this CPU); dp_reshardable is
    refused with a line that says why and what to do."""
    overrides = TINY + layout() + ["parallel.distributed_optimizer=true", f"train.train_steps={STEPS}",
                                   f"checkpoint.save_interval={K}"]
    full = train(tmp_path, "dp2", 2, overrides + ["checkpoint.optimizer_format=fully_reshardable"])
    saved = full.bundle / "checkpoints" / f"iter_{K:07d}"
    _continues_on_one_process(tmp_path / "dp1", overrides, saved, full)

    dp_only = reference_run(2, overrides + ["checkpoint.save_at_end=true"])  # also test_train_resume's DP2 run
    saved = dp_only.bundle / "checkpoints" / f"iter_{K:07d}"
    bundle = write_bundle(tmp_path / "dp1-refused", overrides + [f"checkpoint.load={saved}"], 1)
    proc = run_train(bundle, 1)
    assert proc.returncode != 0
    assert ("saved with checkpoint.optimizer_format=dp_reshardable at DP=2, this run has DP=1; resume at DP=2, "
            "or save with checkpoint.optimizer_format=fully_reshardable") in proc.stdout, proc.stdout
