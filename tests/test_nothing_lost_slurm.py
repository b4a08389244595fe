"""Real local Slurm (slurm/localhost): a job whose time limit comes before training ends is signalled
(--signal=B:USR1), checkpoints, is requeued by its batch script and resumes, until it finishes. No step is
trained twice: every attempt starts right after the step its predecessor checkpointed at."""
from __future__ import annotations

import re
import subprocess
import time

from _rank_harness import crash_site_env
from test_slurm_localhost import FINAL, ONE_RANK, Job, job_info, log_of, render, slurm  # noqa: F401  (slurm: fixture)

TINY_STEPS = ["model.num_layers=4", "model.hidden_size=64", "model.ffn_hidden_size=128",
              "model.num_attention_heads=4", "model.num_query_groups=2", "model.seq_length=64",
              "model.vocab_size=1024", "train.micro_batch_size=2", "train.global_batch_size=8", "data=mock",
              "train.eval_interval=0", "logging.tensorboard=false", "train.warmup_steps=1"]


def _extend_limit_once_requeued(job: Job, limit: str, timeout_s: float) -> None:
    """Wait for the first requeue (the job back in PENDING with Restarts=1: Slurm holds it ~10 s before it is
    eligible again), then give it a longer time limit, as an operator extending a job would: the second start
    reads its new end time and trains to the end. One requeue, whatever the machine's speed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = job_info(job.id)
        if info.get("JobState") in FINAL:
            return  # the asserts below say what went wrong
        if int(info.get("Restarts", "0") or 0) >= 1 and info.get("JobState") == "PENDING":
            subprocess.run(["scontrol", "update", f"JobId={job.id}", f"TimeLimit={limit}"], check=True,
                           capture_output=True, timeout=30)
            return
        time.sleep(0.3)


def test_time_limit_checkpoints_requeues_and_finishes_without_retraining_a_step(slurm, tmp_path):
    total = 200
    # slurmctld sends USR1 up to 30 s before the lead: 5-35 s after the first start (the batch shell traps it
    # within its first second; one that comes before training's first step still gets that step trained and
    # checkpointed, as the STOP file is read after each step). Each step first sleeps 0.25 s
    # (tests/_crash_site LAUNCHER_TEST_STEP_SLEEP): 200 steps last over 50 s whatever the cores' load, mostly off the
    # CPU (560 steps of 50-150 ms were 103 CPU s of the suite). The requeued start trains what is left, so a later
    # window would only cost time (lead 70 s and 800 steps took 170 s); it gets a 10-minute limit
    # (_extend_limit_once_requeued) and finishes.
    bundle = render(tmp_path, *TINY_STEPS, *ONE_RANK, f"train.train_steps={total}", "slurm.time=00:02:00",
                    "slurm.signal_lead_s=85", "slurm.max_requeues=12",
                    # the ranks' own stop guard (2 x save + a step + margin) must not beat USR1 here: on loaded
                    # cores a save took 7 s, which with the default 60 s margin needs 75 s, close to the 85 s lead
                    "slurm.signal_margin_s=0")
    submit = subprocess.run(["sbatch", "--parsable", str(bundle.sbatch)], capture_output=True, text=True, timeout=120,
                            check=True, env=crash_site_env(LAUNCHER_TEST_STEP_SLEEP="0.25"))
    with Job(bundle, submit.stdout.strip().split(";")[0]) as job:
        _extend_limit_once_requeued(job, "00:10:00", 600)
        info = job.wait(900)
    log = log_of(bundle, job.id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log[-6000:]}"
    attempts = re.split(rf"^launcher: job {job.id} restart \d+ on .*$", log, flags=re.MULTILINE)[1:]
    assert len(attempts) == 2 and int(info["Restarts"]) == 1, f"{info}\n{log[-6000:]}"
    left = [int(x) for x in re.findall(r"^slurm: the job ends at .* \(in (\d+) s\)", log, re.MULTILINE)]
    assert left[0] <= 120 < left[1], left  # the requeued start read its own, extended end time
    prev_last = 0
    for i, text in enumerate(attempts):
        steps = [int(s) for s in re.findall(r"^step\s+(\d+) \|", text, re.MULTILINE)]
        assert steps and steps[0] == prev_last + 1, (i, steps[:3], prev_last)
        assert steps == list(range(steps[0], steps[-1] + 1)), i
        prev_last = steps[-1]
        # every start reads its own end time from Slurm (a requeue gets a new one): the ranks' stop guard is armed
        assert re.search(r"^slurm: the job ends at \d\d:\d\d:\d\d UTC \(in \d+ s\); training stops for a "
                         r"checkpoint once less than 2 x the last save .* \+ 0 s is left \(--signal lead 85 s\)$", text,
                         re.MULTILINE), text[:3000]
        if i < len(attempts) - 1:
            assert "launcher: SIGUSR1 received" in text, text[-3000:]
            assert re.search(rf"^launcher: stopped at step {prev_last} of {total}: STOP file; checkpointed", text,
                             re.MULTILINE), text[-3000:]
            assert f"requeueing job {job.id} (requeue {i + 1} of 12;" in text, text[-3000:]
    assert prev_last == total
    assert f"launcher: done: trained to step {total} (DONE)" in attempts[-1]
    assert "launcher: done (DONE written); no requeue needed" in attempts[-1]
    assert not (bundle.path / "STOP").exists()
