"""End to end against a real one-node Slurm on this machine (slurm/localhost/start.sh): sbatch, srun, the
USR1 -> STOP file -> requeue path of job.sbatch, and the real smoke training submitted through Slurm.

These tests fail (they do not skip) when Slurm is absent: if `sinfo` does not answer, the session starts the
cluster with slurm/localhost/start.sh (needs root) and stops the daemons it started when it ends (conftest's
`slurm_cluster`; a cluster it found running is left alone). Jobs are followed with
`scontrol show job` (there is no slurmdbd, hence no sacct), every wait is bounded, and a job still queued or
running when a test fails is cancelled.
"""
from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from launcher.config import compose_job
from launcher.executor import SlurmExecutor
from launcher.problems import errors
from launcher.render import Bundle, cross_check, render_texts, write_bundle
from launcher.validate import validate

FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED", "SPECIAL_EXIT", "REVOKED"}
# The profile's python (.venv/bin/python, relative to the checkout) is replaced by this interpreter, so the
# tests also work from a virtual environment elsewhere.
PROFILE = ["cluster=slurm_local", f"cluster.python={sys.executable}"]
ONE_RANK = ["cluster.gpus_per_node=1", "parallel.tensor=1", "parallel.pipeline=1"]
"""For a test of Slurm's side (time limit, signal, requeue, no-progress rule) where the ranks' layout plays no
part: one rank instead of the smoke recipe's four trains a step of this size in the same wall time on 1/4 of the
CPU, and starts 3 fewer interpreters per attempt (~7 CPU s each). The real 4-rank path stays covered by
test_smoke_training_checkpoints_on_usr1_and_resumes_after_requeue."""


@pytest.fixture(scope="module")
def slurm(slurm_cluster):
    """A responding one-node Slurm cluster: tests/conftest.py's session fixture starts it with
    slurm/localhost/start.sh when `sinfo` does not answer, and stops at the session's end what it started."""
    return True


def job_info(job_id: str) -> dict[str, str]:
    """`scontrol show job -o` as a dict (JobState, Restarts, ExitCode, NodeList, ...); {} once it is forgotten."""
    proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))


def log_of(bundle: Bundle, job_id: str) -> str:
    path = bundle.path / "logs" / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else f"(no {path})"


class Job:
    """A job submitted with SlurmExecutor (or already submitted: job_id), cancelled on the way out unless it
    reached a final state."""

    def __init__(self, bundle: Bundle, job_id: str | None = None):
        self.bundle = bundle
        self.id = job_id or SlurmExecutor().submit(bundle)
        self.info: dict[str, str] = {}

    def wait(self, timeout_s: float) -> dict[str, str]:
        """Poll until the job reaches a final state (a requeued job passes through PENDING). A hang detector on
        progress: it fails only after ``timeout_s`` without a new line in the job's log or a new job state, so a
        slow machine is not called hung (at load 50 a finished job's ranks took over 30 s to exit after the log's
        last line, and a fixed total had failed a run that trained and requeued correctly)."""
        deadline, seen = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            self.info = job_info(self.id) or self.info
            if self.info.get("JobState") in FINAL:
                return self.info
            now = (self.info.get("JobState"), len(log_of(self.bundle, self.id)))
            if now != seen:
                deadline, seen = time.monotonic() + timeout_s, now
            time.sleep(1)
        raise AssertionError(f"job {self.id} not finished, nothing new for {timeout_s:.0f} s: "
                             f"{self.info.get('JobState')}\n--- log ---\n{log_of(self.bundle, self.id)}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if job_info(self.id).get("JobState") not in FINAL:
            subprocess.run(["scancel", self.id], capture_output=True, timeout=30)
        return False


def render(tmp_path: Path, *overrides: str) -> Bundle:
    """A real bundle for the smoke recipe on the slurm_local profile, as action=render writes it."""
    job = compose_job(["recipe=smoke", *PROFILE, f"output_dir={tmp_path}", *overrides])
    assert errors(validate(job)) == []
    assert cross_check(job, render_texts(job, tmp_path / "bundle")) == []
    bundle = write_bundle(job, argv=["test_slurm_localhost", *overrides])
    assert "#SBATCH --gpus-per-node" not in bundle.sbatch.read_text()  # cpu profile: no GPU request
    assert f"\n{shlex.quote(sys.executable)} -m launcher.rank.agent" in bundle.launch.read_text()
    return bundle


def replace_launch(bundle: Bundle, body: str) -> None:
    """Swap the bundle's torchrun command for a small script (keeps these tests independent of training)."""
    bundle.launch.write_text("#!/bin/bash\nset -euo pipefail\n" + body)


PRINT_ENV = """\
source "$LAUNCHER_BUNDLE/env.sh"
echo "probe: SLURM_JOB_ID=$SLURM_JOB_ID"
echo "probe: MASTER_ADDR=$MASTER_ADDR"
echo "probe: MASTER_PORT=$MASTER_PORT"
echo "probe: LAUNCHER_BUNDLE=$LAUNCHER_BUNDLE"
echo "probe: OMP_NUM_THREADS=$OMP_NUM_THREADS"
echo "probe: SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0}"
echo "probe: resolved $(getent hosts "$MASTER_ADDR" | awk '{print $1; exit}')"
"""


def probe_values(log: str) -> dict[str, str]:
    return dict(re.findall(r"^probe: (\w+)=(.*)$", log, re.MULTILINE))


def test_trivial_bundle_runs_to_completion(slurm, tmp_path):
    bundle = render(tmp_path, "slurm.time=00:10:00")
    # Like training, the stand-in writes DONE when it has finished (a run ending without DONE is requeued).
    replace_launch(bundle, PRINT_ENV + 'touch "$LAUNCHER_BUNDLE/DONE"\n')
    with Job(bundle) as job:
        assert (bundle.path / "submission.json").read_text().count(job.id) == 1
        info = job.wait(90)
    log = log_of(bundle, job.id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log}"
    node = info["NodeList"]
    assert f"launcher: job {job.id} restart 0 on {node}" in log, log
    values = probe_values(log)
    assert values["SLURM_JOB_ID"] == job.id, log
    assert values["MASTER_ADDR"] == node, log  # the allocation's first (only) node, from scontrol
    assert socket.gethostbyname(values["MASTER_ADDR"]), log
    assert re.search(r"^probe: resolved \d+\.\d+\.\d+\.\d+$", log, re.MULTILINE), log  # resolvable on the node
    assert values["MASTER_PORT"] == "29500", log
    assert values["LAUNCHER_BUNDLE"] == str(bundle.path), log
    assert values["OMP_NUM_THREADS"] == "1", log  # env.sh from the cluster profile was sourced
    assert values["SLURM_RESTART_COUNT"] == "0", log


def test_usr1_leaves_stop_file_and_job_is_requeued(slurm, tmp_path):
    # slurmctld checks time limits every 30 s (PERIODIC_TIMEOUT) and sends --signal up to 30 s before
    # lead time, so with 120 s and a lead of 85 s USR1 arrives 5-35 s after the start (the batch shell traps it
    # within its first second; a lead of 80 s waited 5 s longer for nothing). The first run waits for the STOP
    # file the batch shell leaves on USR1; the requeued run (SLURM_RESTART_COUNT=1) exits at once, well before
    # USR1 could come again.
    bundle = render(tmp_path, "slurm.time=00:02:00", "slurm.signal_lead_s=85")
    assert "#SBATCH --requeue" in bundle.sbatch.read_text()
    assert "#SBATCH --signal=B:USR1@85" in bundle.sbatch.read_text()
    replace_launch(bundle, PRINT_ENV + """\
if (( ${SLURM_RESTART_COUNT:-0} >= 1 )); then echo "probe: requeued run, nothing left to do"; touch "$LAUNCHER_BUNDLE/DONE"; exit 0; fi
for i in $(seq 110); do
  if [[ -f "$LAUNCHER_BUNDLE/STOP" ]]; then echo "probe: STOP file seen after ${i} s"; exit 0; fi
  sleep 1
done
echo "probe: no STOP file within 110 s"; exit 3
""")
    with Job(bundle) as job:
        info = job.wait(180)
    log = log_of(bundle, job.id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log}"
    assert info["Restarts"] == "1", f"{info}\n{log}"
    first, sep, second = log.partition(f"launcher: job {job.id} restart 1 on ")
    assert sep, f"no second run in the log:\n{log}"
    assert f"launcher: job {job.id} restart 0 on " in first, log
    assert "launcher: SIGUSR1 received, asking training to checkpoint and stop" in first, log
    assert "probe: STOP file seen after" in first, log
    assert "launcher: stopped before the time limit (" in first and f"requeueing job {job.id} (requeue 1 of 3" in first, log
    assert "probe: SLURM_RESTART_COUNT=1" in second, log
    assert "probe: requeued run, nothing left to do" in second, log
    assert "requeueing" not in second, log
    assert not (bundle.path / "STOP").exists()  # the batch shell removes it before requeueing


def test_smoke_training_checkpoints_on_usr1_and_resumes_after_requeue(slurm, tmp_path):
    # USR1 is sent to the batch shell by hand (`scancel --batch --signal=USR1`, the same delivery as
    # --signal=B:USR1) once training is under way, so the test does not depend on slurmctld's 30 s timer. The
    # time limit is long enough that Slurm's own USR1 never comes. Expected: training checkpoints and exits 0,
    # the batch shell requeues, the second run resumes after the last step of the first and finishes.
    # Submitted as a user submits it: `python -m launcher ... action=submit` (plan, render, sbatch), then
    # srun -> launch.sh -> torchrun (c10d rendezvous at MASTER_ADDR) -> 4 gloo ranks, TP=2 x PP=2, synthetic
    # tokens. (This was two tests, a plain submitted run and this one; one Slurm training job covers both.)
    steps_total = 10
    proc = subprocess.run([sys.executable, "-m", "launcher", "recipe=smoke", *PROFILE, f"train.train_steps={steps_total}",
                           "train.warmup_steps=0", "train.eval_interval=0", "data=mock", "slurm.time=00:10:00",
                           "slurm.signal_lead_s=60", f"output_dir={tmp_path}", "action=submit"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    submitted = re.search(r"^submitted: job (\d+)", proc.stdout, re.MULTILINE)
    assert submitted, proc.stdout
    (bundle_dir,) = [p.parent for p in tmp_path.glob("*/submission.json")]
    bundle, job_id = Bundle(bundle_dir), submitted.group(1)
    assert json.loads((bundle.path / "submission.json").read_text()) == {"job_id": job_id}
    assert f"\n{shlex.quote(sys.executable)} -m launcher.rank.agent" in bundle.launch.read_text()
    log_path = bundle.path / "logs"
    with Job(bundle, job_id) as job:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if len(re.findall(r"^step\s+\d+ \|", log_of(bundle, job.id), re.MULTILINE)) >= 2:
                break
            assert job_info(job.id).get("JobState") not in FINAL, log_of(bundle, job.id)
            time.sleep(0.5)
        else:
            raise AssertionError(f"training did not reach step 2 in 120 s\n{log_of(bundle, job.id)[-6000:]}")
        subprocess.run(["scancel", "--batch", "--signal=USR1", job.id], check=True, timeout=30)
        signalled_at = len(re.findall(r"^step\s+\d+ \|", log_of(bundle, job.id), re.MULTILINE))
        deadline = time.monotonic() + 180
        while job_info(job.id).get("JobState") not in FINAL and time.monotonic() < deadline:
            first_run = log_of(bundle, job.id).partition(f"launcher: job {job.id} restart 1 on ")[0]
            steps = len(re.findall(r"^step\s+\d+ \|", first_run, re.MULTILINE))
            assert steps <= signalled_at + 3, f"training ran {steps - signalled_at} steps past USR1 (STOP file)"
            time.sleep(0.5)
        info = job.wait(120)
    log = log_of(bundle, job.id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log[-6000:]}"
    assert info["Restarts"] == "1", f"{info}\n{log[-6000:]}"
    first, sep, second = log.partition(f"launcher: job {job.id} restart 1 on ")
    assert sep, log[-6000:]
    steps1 = [int(s) for s in re.findall(r"^step\s+(\d+) \|", first, re.MULTILINE)]
    steps2 = [int(s) for s in re.findall(r"^step\s+(\d+) \|", second, re.MULTILINE)]
    assert steps1 and steps1[-1] < steps_total, f"the first run did not stop early: {steps1}"
    assert steps2 and steps2[0] == steps1[-1] + 1 and steps2[-1] == steps_total, (steps1, steps2)
    assert all(float(loss) > 0 for loss in re.findall(r"^step\s+\d+ \| loss ([\d.]+)", log, re.MULTILINE)), log[-6000:]
    assert list(log_path.glob("slurm-*.out")) == [log_path / f"slurm-{job.id}.out"]
    assert not (bundle.path / "STOP").exists()
