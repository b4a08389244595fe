"""The resume plan (issue 42): ``action=validate``/``action=plan`` say whether a job continues from the checkpoint it is
given (as is, resharded, converted, or refused with one line and exit 2) and ``checkpoint-info`` says what a
checkpoint is, from its own metadata on the login node. Each verdict is checked against what the ranks then do:
the job is run and loads (with the uninterrupted run's losses) or is refused naming the same thing."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _rank_harness import ROOT, TINY, Run, layout, run_train, write_bundle

STEPS, K = 6, 3
BASE = TINY + [f"train.train_steps={STEPS}", f"checkpoint.save_interval={K}"]
DIST = BASE + layout() + ["parallel.distributed_optimizer=true"]
"""test_checkpoint_reshard's DP jobs: their uninterrupted runs are the session's reference runs too."""


def _verdict(overrides, nproc, capsys, action="validate"):
    """``python -m launcher ... action=validate`` in this process: (exit code, stdout, stderr)."""
    from launcher.cli import main

    capsys.readouterr()
    code = main([*overrides, f"cluster.gpus_per_node={nproc}", f"action={action}"])
    out = capsys.readouterr()
    return code, out.out, out.err


def _plan(overrides, nproc):
    """The ResumePlan object of a job (paths absolute, as the CLI makes them)."""
    from launcher.config import compose_job
    from launcher.core import derive
    from launcher.core.paths import with_absolute_paths
    from launcher.resume_plan import resume_plan

    job = with_absolute_paths(compose_job([*overrides, f"cluster.gpus_per_node={nproc}"]))
    return resume_plan(job, derive(job))


def _continues(where: Path, overrides, nproc, saved: Path, full: Run) -> Run:
    """The job loads ``saved`` (step K) and trains K+1.. with the uninterrupted run's losses."""
    bundle = write_bundle(where, overrides, nproc)
    proc = run_train(bundle, nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resumed from {saved} at step {K} ({K * 8} samples consumed)" in proc.stdout, proc.stdout
    resumed = Run(bundle, proc)
    assert sorted(resumed.steps) == list(range(K + 1, STEPS + 1))
    for step in resumed.steps:
        assert resumed.losses()[step] == pytest.approx(full.losses()[step], rel=1e-5), step
    return resumed


def _refused_by_ranks(where: Path, overrides, nproc) -> str:
    bundle = write_bundle(where, overrides, nproc)
    proc = run_train(bundle, nproc)
    assert proc.returncode != 0, proc.stdout[-3000:]
    return proc.stdout


@pytest.fixture
def dp2(reference_run):
    """DP2 with the distributed optimizer, default checkpoint.optimizer_format=dp_reshardable; its step-K checkpoint."""
    full = reference_run(2, DIST + ["checkpoint.save_at_end=true"])
    return full, full.bundle / "checkpoints" / f"iter_{K:07d}"


@pytest.fixture
def dp2_fully(reference_run):
    full = reference_run(2, DIST + ["checkpoint.optimizer_format=fully_reshardable"])
    return full, full.bundle / "checkpoints" / f"iter_{K:07d}"


def test_same_layout_loads_as_is_and_does(tmp_path, capsys, dp2):
    full, saved = dp2
    job = DIST + [f"checkpoint.load={saved}"]
    code, out, err = _verdict(job, 2, capsys)
    assert code == 0, err
    assert f"resume: {saved} (step {K}, checkpoint.load): loads as is" in out
    # the count the saving rank recorded in the manifest (launcher/rank/entry.py save), not step x batch
    assert (f"data: {K * 8} samples consumed; step {K + 1} reads samples {K * 8}..{K * 8 + 7} (2 micro-batches of 2 "
            f"per DP rank; 2 DP ranks, rank r from sample {K * 8} + 2r, every 4)") in out
    plan = _plan(job, 2)
    assert (plan.verdict, plan.changes, plan.step, plan.consumed) == ("as_is", [], K, K * 8)
    _continues(tmp_path / "same", job, 2, saved, full)


def test_dp_change_with_dp_reshardable_is_refused_before_and_by_the_ranks(tmp_path, capsys, dp2):
    full, saved = dp2
    job = DIST + [f"checkpoint.load={saved}"]
    code, out, err = _verdict(job, 1, capsys)
    assert code == 2 and "valid:" not in out and "resume:" not in out
    assert err.splitlines() == [
        f"error: checkpoint.load={str(saved)!r}: iter_{K:07d}'s distributed-optimizer state was saved with "
        "checkpoint.optimizer_format=dp_reshardable at DP=2, this run has DP=1: it loads only at DP=2 (the ranks "
        "refuse it after building the model); try cluster.gpus_per_node=2 (DP=2, as saved), or a checkpoint saved "
        "with checkpoint.optimizer_format=fully_reshardable"], err
    code, _, err2 = _verdict(job, 1, capsys, action="plan")  # plan refuses it too, with the same line
    assert code == 2 and err2 == err
    # the ranks: the same rule, after building the model
    stdout = _refused_by_ranks(tmp_path / "dp1", job, 1)
    assert "saved with checkpoint.optimizer_format=dp_reshardable at DP=2, this run has DP=1" in stdout, stdout


def test_dp_change_with_fully_reshardable_reshards_and_does(tmp_path, capsys, dp2_fully):
    full, saved = dp2_fully
    job = DIST + ["checkpoint.optimizer_format=fully_reshardable", f"checkpoint.load={saved}"]
    code, out, err = _verdict(job, 1, capsys)
    assert code == 0, err
    assert f"resume: {saved} (step {K}, checkpoint.load): loads after resharding (DP 2 -> 1)" in out
    assert "data: DP 2 -> 1: the same global sample order, each step's samples split over 1 rank(s) instead of 2" in out
    assert "the RNG streams start afresh" in out
    _continues(tmp_path / "dp1", job, 1, saved, full)


def test_tp_change_reshards_and_does(tmp_path, capsys, reference_run):
    full = reference_run(2, BASE + layout(tp=2))
    saved = full.bundle / "checkpoints" / f"iter_{K:07d}"
    job = BASE + layout() + [f"checkpoint.load={saved}"]
    plan = _plan(job, 1)
    assert (plan.verdict, plan.changes) == ("reshard", ["TP 2 -> 1"])
    code, out, _ = _verdict(job, 1, capsys, action="plan")
    assert code == 0 and f"resume: {saved} (step {K}, checkpoint.load): loads after resharding (TP 2 -> 1)" in out
    _continues(tmp_path / "tp1", job, 1, saved, full)


def test_a_changed_model_field_is_refused_before_and_by_the_ranks(tmp_path, capsys, dp2):
    _, saved = dp2
    job = DIST + ["model.hidden_size=128", f"checkpoint.load={saved}"]
    code, out, err = _verdict(job, 2, capsys)
    assert code == 2 and not out
    assert err == (f"error: model.hidden_size=128: checkpoint.load={saved} holds weights of another model "
                   "(model.hidden_size=64 there, 128 here): the ranks refuse it before loading; try "
                   "model.hidden_size=64, or a checkpoint of this model\n")
    stdout = _refused_by_ranks(tmp_path / "wider", job, 2)
    assert "its weights are of another model (model.hidden_size=64 there, 128 here)" in stdout, stdout
    assert "set model.hidden_size=64" in stdout


def test_another_run_in_checkpoint_dir_is_refused_with_the_load_that_continues_it(tmp_path, capsys, dp2):
    _, saved = dp2
    code, _, err = _verdict(DIST + ["train.global_batch_size=16", f"checkpoint.dir={saved.parent}"], 2, capsys)
    assert code == 2
    assert err.startswith(f"error: checkpoint.dir={str(saved.parent)!r}: holds checkpoints of another run (iter_")
    assert "train.global_batch_size=8 there, 16 here); try checkpoint.load=" in err
    # and with that load: the batch change's consequences for the data loader
    plan = _plan(DIST + ["train.global_batch_size=16", f"checkpoint.load={saved}"], 2)
    assert plan.verdict == "as_is" and plan.consumed == K * 8
    assert (f"data: train.global_batch_size 8 -> 16: the step count continues at {K} (the LR schedule is in steps) "
            f"and the samples at {K * 8}, not at {K} x 16") in plan.data


def test_fsdp_and_ddp_convert_or_are_refused_by_optimizer_format(capsys, dp2, dp2_fully):
    _, fully = dp2_fully
    plan = _plan(DIST + ["parallel.megatron_fsdp=true", f"checkpoint.load={fully}"], 2)
    assert plan.verdict == "convert", plan
    assert plan.changes == ["torch_dist -> fsdp_dtensor (DDP + distributed optimizer -> Megatron-FSDP), converted in "
                            "memory on the ranks (launcher/rank/checkpoint/convert.py), then saved as fsdp_dtensor"]
    _, dp_resh = dp2
    code, _, err = _verdict(DIST + ["parallel.megatron_fsdp=true", f"checkpoint.load={dp_resh}"], 2, capsys)
    assert code == 2
    assert err == (f"error: parallel.megatron_fsdp=True: checkpoint {dp_resh} is in the torch_dist format with "
                   "checkpoint.optimizer_format=dp_reshardable: the distributed optimizer's state is each DP rank's "
                   "flat buffer slice there, which cannot be converted to fsdp_dtensor; try "
                   "parallel.megatron_fsdp=false\n")


def test_a_checkpoint_without_its_manifest(tmp_path, capsys, dp2):
    _, saved = dp2
    copy = tmp_path / "ckpts" / saved.name
    shutil.copytree(saved, copy)
    (copy / "launcher.json").unlink()
    code, _, err = _verdict(DIST + [f"checkpoint.dir={copy.parent}"], 2, capsys)
    assert code == 2 and "holds checkpoints without launcher.json (incomplete, or written by another tool)" in err
    # named explicitly, it loads (the ranks read step and consumed samples from it); checkpoint-info reads them
    plan = _plan(DIST + [f"checkpoint.load={copy}"], 2)
    assert plan.verdict == "as_is" and any("no launcher.json identity" in n for n in plan.notes)
    out = subprocess.run([sys.executable, "-m", "launcher", "checkpoint-info", str(copy), "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    info = json.loads(out.stdout)
    assert (info["step"], info["consumed_samples"], info["complete"]) == (K, K * 8, False), out.stderr
    assert info["consumed_from"] == "read from the checkpoint"


def test_a_missing_file_makes_the_ranks_fall_back_and_the_plan_says_so(tmp_path, capsys, dp2):
    full, saved = dp2
    copy = tmp_path / "ckpts"
    shutil.copytree(saved.parent, copy, ignore=shutil.ignore_patterns("LOCK*"))
    newest = copy / f"iter_{STEPS:07d}"
    victim = sorted(newest.glob("*.distcp"))[-1]
    victim.unlink()
    plan = _plan(DIST + [f"checkpoint.dir={copy}"], 2)  # this run's own checkpoints: the newest is damaged
    assert plan.verdict == "as_is" and plan.checkpoint == str(copy / f"iter_{K:07d}")
    assert plan.skipped == [f"{newest.name}: 1 damaged file(s): {victim.name} is missing"]
    # alone, it does not load at all
    only = _plan(DIST + [f"checkpoint.load={newest}"], 2)
    assert only.verdict == "refused" and only.problem.field == "checkpoint.load"
    assert f"{victim.name} is missing" in only.problem.rule
    out = subprocess.run([sys.executable, "-m", "launcher", "checkpoint-info", str(newest)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120).stdout
    assert f"NOT loadable as is: {victim.name} is missing" in out, out


def test_checkpoint_info_reads_the_checkpoint_alone(capsys, dp2):
    from launcher.cli import main

    full, saved = dp2
    capsys.readouterr()
    assert main(["checkpoint-info", str(saved.parent)]) == 0  # a directory: its newest complete checkpoint
    out = capsys.readouterr().out.splitlines()
    newest = saved.parent / f"iter_{STEPS:07d}"
    assert out[0] == f"checkpoint {newest} (1 older beside it: {saved.name})"
    assert out[3] == "  layout: TP1 PP1 VPP1 EP1 CP1 DP2, DDP + distributed optimizer"
    assert out[4] == "  format: torch_dist; optimizer state: dp_reshardable"
    assert out[5] == (f"  data: {STEPS * 8} samples consumed (read from the checkpoint), global batch 8 (micro batch "
                      f"2); the next step reads from sample {STEPS * 8}")
    assert out[6].endswith(", complete")
    assert main(["checkpoint-info", str(saved), "--json", "--no-state"]) == 0  # launcher.json alone: no torch
    info = json.loads(capsys.readouterr().out)
    assert "common_state" not in info and info["consumed_samples"] == K * 8
    assert info["model"]["model.hidden_size"] == 64 and info["layout"]["DP"] == 2
    assert main(["checkpoint-info", str(saved.parent / "nothing")]) == 2
    said = capsys.readouterr()  # the CLI's one refusal line, on stderr
    assert said.out == "" and said.err.startswith(f"error: {saved.parent / 'nothing'}: no checkpoint there"), said


def test_after_a_global_batch_change_the_checkpoint_counts_what_was_consumed(tmp_path, capsys, dp2):
    """A run that loaded step K of global batch 8 and went on with 16: its checkpoints hold 8K + 16 per step since,
    which checkpoint-info reads from the checkpoint (the manifest's step x batch would say 16 per step)."""
    from launcher.cli import main

    _, saved = dp2
    job = DIST + ["train.global_batch_size=16", f"checkpoint.load={saved}"]
    plan = _plan(job, 2)
    assert plan.verdict == "as_is" and plan.consumed == K * 8
    bundle = write_bundle(tmp_path / "gbs16", job, 2)
    proc = run_train(bundle, 2)
    assert proc.returncode == 0 and f"resumed from {saved} at step {K} ({K * 8} samples consumed)" in proc.stdout
    capsys.readouterr()
    assert main(["checkpoint-info", str(bundle / "checkpoints"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["step"], info["consumed_samples"]) == (STEPS, K * 8 + (STEPS - K) * 16)
    assert info["consumed_from"] == "read from the checkpoint"
    # the saving rank records the exact count in the manifest too (step x batch would say STEPS * 16): the login
    # node's plan reads it without torch
    manifest = json.loads((bundle / "checkpoints" / f"iter_{STEPS:07d}" / "launcher.json").read_text())
    assert manifest["consumed_samples"] == K * 8 + (STEPS - K) * 16 != STEPS * 16


def test_a_virtual_pipeline_change_reshards_and_does(tmp_path, reference_run):
    full = reference_run(2, BASE + layout(pp=2, vpp=2))
    saved = full.bundle / "checkpoints" / f"iter_{K:07d}"
    job = BASE + layout(pp=2) + [f"checkpoint.load={saved}"]
    plan = _plan(job, 2)
    assert (plan.verdict, plan.changes, plan.notes) == ("reshard", ["VPP 2 -> 1"], [])  # same (PP, TP, DP): RNG kept
    _continues(tmp_path / "novpp", job, 2, saved, full)


def test_resume_false_starts_fresh_or_is_refused_over_another_runs_checkpoints(dp2):
    _, saved = dp2  # verdicts only: running these would move the reference run's checkpoints aside
    plan = _plan(DIST + [f"checkpoint.dir={saved.parent}", "checkpoint.resume=false"], 2)
    assert (plan.verdict, plan.notes) == ("fresh", ["checkpoint.resume=false: this run's 2 checkpoint(s) there are "
                                                    "moved aside"])
    plan = _plan(DIST + [f"checkpoint.dir={saved.parent}", "checkpoint.resume=false", "train.seed=2"], 2)
    assert plan.verdict == "refused" and plan.problem.line() == (
        f"error: checkpoint.dir={str(saved.parent)!r}: holds checkpoints of another run (iter_{STEPS:07d}: train.seed="
        "1234 there, 2 here); checkpoint.resume=false would overwrite them; try another checkpoint.dir")


@pytest.mark.parametrize("change,field,theirs", [("parallel.distributed_optimizer=false", "parallel.distributed_optimizer",
                                                  "true"),
                                                 ("precision.dtype=bf16", "precision.dtype", "fp32")])
def test_an_optimizer_state_of_another_structure_is_refused_before_and_fails_on_the_ranks(tmp_path, capsys, dp2,
                                                                                           change, field, theirs):
    """The distributed vs the plain optimizer, fp32 vs bf16 (an fp32 main copy or none): the ranks fail in
    dist_checkpointing's load after building the model, with no field named; the plan names it first."""
    _, saved = dp2
    job = DIST + [change, f"checkpoint.load={saved}"]
    code, out, err = _verdict(job, 2, capsys)
    assert code == 2 and not out
    (line,) = err.splitlines()
    assert line.startswith(f"error: {field}=") and line.endswith(f"try {field}={theirs}, as saved"), line
    assert "(the ranks fail to load it after building the model)" in line
    stdout = _refused_by_ranks(tmp_path / "other", job, 2)
    assert f"error: checkpoint.load={saved}: could not be loaded into this run (tried {saved.name}; last error: " \
           in stdout, stdout
