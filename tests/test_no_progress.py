"""The no-progress rule (issue 27 item 2): a crash that repeats at the same step, from the same checkpoint, stops
the run after its first repeat with one line naming the step and the error, instead of burning every torchrun
restart and Slurm requeue on it. The crash is injected by tests/_crash_site (rank R raises in step K on every
attempt: a deterministic bug)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from _rank_harness import ROOT, TINY, communicate_on_progress, crash_site_env, layout
from launcher.rank import progress



def _attempt(id_, resumed, reached, saved=None, outcome=None, error=None):
    return {"id": id_, "resumed": resumed, "reached": reached, "saved": saved, "outcome": outcome, "error": error}


def test_verdict_after_a_crash_at_the_same_step_without_a_new_checkpoint():
    a = _attempt("requeue 0, restart 0", 0, 7, saved=5, error="rank 1 at step 8: RuntimeError: boom")
    b = _attempt("requeue 0, restart 1", 5, 7, error="rank 1 at step 8: RuntimeError: boom")
    line = progress.verdict([a, b])
    assert line == ("no progress: attempts 'requeue 0, restart 0' and 'requeue 0, restart 1' both failed at step 8, "
                    "the second after resuming from the checkpoint of step 5 and saving no checkpoint (last error: "
                    "rank 1 at step 8: RuntimeError: boom); not restarting or requeueing: fix the cause, then run the "
                    "bundle again (it resumes from the checkpoint of step 5)")
    assert progress.verdict([b]) is None                                       # one crash: a retry is worth it
    assert progress.verdict([a, {**b, "reached": 9}]) is None                  # got further
    assert progress.verdict([a, {**b, "saved": 6}]) is None                    # saved one on the way
    assert progress.verdict([a, {**b, "outcome": "stopped"}]) is None          # stopped for the time limit
    assert progress.verdict([{**a, "outcome": "stopped"}, b]) is None
    assert "from the start" in progress.verdict([{**a, "saved": None, "reached": 3},
                                                 {**b, "resumed": 0, "reached": 3}])
    early = progress.verdict([{**a, "resumed": None, "reached": None}, {**b, "resumed": None, "reached": None,
                                                                         "error": None}], last_error="rank 2: OSError: x")
    assert "both failed before their first step" in early and "last error: rank 2: OSError: x" in early
    killed = progress.verdict([{**a, "error": None}, {**b, "error": None}])
    assert "no Python error: a rank was killed or crashed in native code" in killed


def test_attempt_records_and_the_first_error_of_each_attempt(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = progress.Attempt(tmp_path, rank=0)
    first.start()
    first.update(resumed=5, reached=5)
    first.update(reached=7)
    progress.record_error(tmp_path, 1, 7, RuntimeError("boom\nmore lines"))
    progress.record_error(tmp_path, 0, 7, RuntimeError("Connection closed by peer"))  # the echo: not kept
    assert progress.check(tmp_path) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = progress.Attempt(tmp_path, rank=0)
    second.start()
    assert progress.read(tmp_path)[0]["error"] == "rank 1 at step 8: RuntimeError: boom"
    second.update(resumed=5, reached=5)
    second.update(reached=7)
    progress.record_error(tmp_path, 1, 7, RuntimeError("boom"))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    line = progress.check(tmp_path)
    assert line.startswith("no progress: attempts 'requeue 0, restart 0' and 'requeue 0, restart 1' both failed "
                           "at step 8, the second after resuming from the checkpoint of step 5") \
        and "last error: rank 1 at step 8: RuntimeError: boom" in line


def test_running_the_bundle_again_starts_afresh(tmp_path, monkeypatch):
    """After a fix, `bash launch.sh` again (or a new sbatch) is a new launch: the old attempts do not stop it."""
    crashed = [_attempt("requeue 0, restart 0", 0, 7, saved=5), _attempt("requeue 0, restart 1", 5, 7)]
    (tmp_path / progress.PROGRESS).write_text(json.dumps({"attempts": [{**a, "launch": "local-1-1"} for a in crashed]}))
    monkeypatch.setenv(progress.LAUNCH_ENV, "local-1-1")
    assert progress.check(tmp_path).startswith("no progress:")  # a torchrun restart of that launch
    monkeypatch.setenv(progress.LAUNCH_ENV, "local-2-2")
    assert progress.check(tmp_path) is None                        # the bundle run again


def _crash_env(step: int, rank: int) -> dict:
    return crash_site_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
                          LAUNCHER_TEST_CRASH_AT_STEP=str(step), LAUNCHER_TEST_CRASH_RANK=str(rank))


def test_a_crash_that_repeats_at_the_same_step_stops_after_the_first_repeat(tmp_path):
    overrides = [*TINY, *layout(tp=2), "train.train_steps=20", "checkpoint.save_interval=5", "cluster.max_restarts=3",
                 "data.num_workers=0"]
    cmd = [sys.executable, "-m", "launcher", *overrides, "cluster.gpus_per_node=2", f"output_dir={tmp_path}",
           "action=run"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_crash_env(8, 1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    out, _ = communicate_on_progress(proc, 300, "the crash-loop run")
    assert proc.returncode != 0, out[-3000:]
    trained = [int(s) for s in re.findall(r"^step\s+(\d+) \|", out, re.MULTILINE)]
    assert trained == [1, 2, 3, 4, 5, 6, 7, 6, 7], out[-4000:]  # attempt 1, then one repeat from step 5's save
    errors = [line for line in out.splitlines() if line.startswith("error: no progress")]
    assert errors == [("error: no progress: attempts 'requeue 0, restart 0' and 'requeue 0, restart 1' both failed "
                       "at step 8, the second after resuming from the checkpoint of step 5 and saving no checkpoint "
                       "(last error: rank 1 at step 8: RuntimeError: injected crash in step 8); not restarting or "
                       "requeueing: fix the cause, then run the bundle again (it resumes from the checkpoint of "
                       "step 5)")], out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    bundle = next(p for p in tmp_path.iterdir() if (p / "progress.json").is_file())
    attempts = json.loads((bundle / "progress.json").read_text())["attempts"]
    assert [(a["resumed"], a["reached"], a["saved"]) for a in attempts] == [(0, 7, 5), (5, 7, None)]
    assert (bundle / "FAILED").read_text().startswith("no progress:")
    assert re.search(r"^launcher: failed: no progress: ", out, re.MULTILINE), out[-2000:]


def test_the_job_script_does_not_requeue_a_run_without_progress(slurm_cluster, tmp_path):
    from test_slurm_localhost import ONE_RANK, Job, log_of, render

    bundle = render(tmp_path, *TINY[1:], *ONE_RANK, "data=mock", "train.train_steps=20", "checkpoint.save_interval=5",
                    "cluster.max_restarts=2", "slurm.max_requeues=3", "data.num_workers=0")
    env = _crash_env(8, 0)
    submit = subprocess.run(["sbatch", "--parsable", str(bundle.sbatch)], env=env, capture_output=True, text=True,
                            timeout=120, check=True)
    job_id = submit.stdout.strip().split(";")[0]
    with Job(bundle, job_id) as job:
        info = job.wait(600)
    log = log_of(bundle, job.id)
    assert info["JobState"] == "FAILED" and int(info["Restarts"]) == 0, f"{info}\n{log[-4000:]}"
    assert re.search(r"^launcher: failed: no progress: attempts 'requeue 0, restart 0' and 'requeue 0, restart 1' "
                     r"both failed at step 8", log, re.MULTILINE), log[-4000:]
    assert "not requeueing" in log and "requeueing job" not in log, log[-3000:]
    assert len(re.findall(r"^step\s+7 \|", log, re.MULTILINE)) == 2, log[-4000:]
    assert not Path(bundle.path / "DONE").exists()


def test_a_data_file_truncated_after_render_is_not_retried(tmp_path):
    """Item 2's other half: a data error on the ranks (a .bin truncated after the pre-flight) was retried by every
    torchrun restart like a crash. Every restart now stops at once (FAILED): the file is named once, nothing trains."""
    import shutil

    shipped = ROOT / "data" / "assets" / "smoke_text_document"
    (tmp_path / "data").mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(str(shipped) + ext, tmp_path / "data" / f"d{ext}")
    render = subprocess.run([sys.executable, "-m", "launcher", "recipe=smoke", f"data.blend=[{tmp_path / 'data' / 'd'}]",
                             "cluster.gpus_per_node=1", "parallel.tensor=1", "parallel.pipeline=1",
                             "cluster.max_restarts=2", "train.train_steps=4", "train.eval_interval=0",
                             "data.num_workers=0", f"output_dir={tmp_path / 'runs'}", "action=render"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert render.returncode == 0, render.stderr[-2000:]
    bundle = next((tmp_path / "runs").iterdir())
    os.truncate(tmp_path / "data" / "d.bin", 1000)
    proc = subprocess.Popen(["bash", str(bundle / "launch.sh")], cwd=ROOT, env=_crash_env(10**6, 0),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out, _ = communicate_on_progress(proc, 300, "the truncated-data run")
    assert proc.returncode == 1, out[-3000:]
    named = [line for line in out.splitlines() if line.startswith("error: data.blend=")]
    assert len(named) == 1 and f"{tmp_path / 'data' / 'd.bin'} is 1,000 bytes" in named[0], out[-3000:]
    assert not re.findall(r"^step\s+\d+ \|", out, re.MULTILINE) and "Traceback" not in out, out[-3000:]
    assert out.rstrip().splitlines()[-1].startswith("launcher: failed: data.blend="), out[-2000:]
    assert (bundle / "FAILED").read_text().startswith("data.blend=")
