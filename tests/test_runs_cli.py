"""`python -m launcher runs|status|logs|cancel` (launcher/runs.py) against real local runs of a tiny job started the
way a user starts one (`python -m launcher ... action=run`): a run that finished, a run that failed and says why in
one line, a running run that `cancel` stops with a checkpoint first; bad input gets one line and exit 2.

The login commands run from the test's directory, whose `runs/` is the default output dir they read. Every wait
is a hang detector on progress (tests/test_nothing_lost.py `wait_for`), never a duration."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from _rank_harness import ROOT, TINY, kill_tree, layout
from test_nothing_lost import finish, wait_for

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
ONE_RANK = [*TINY, *layout(), "cluster.gpus_per_node=1", "checkpoint.save_interval=0"]
HEADER = ["NAME", "MODEL", "LAYOUT", "SCHEDULER", "STATE", "STEP", "LOSS", "ETA", "ATTEMPTS", "CHECKPOINT", "PPL"]


def launch(tmp_path: Path, name: str, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    """`python -m launcher ... action=run` into tmp_path/runs, in its own session (as a user's terminal holds it)."""
    cmd = [sys.executable, "-m", "launcher", *ONE_RANK, *overrides, f"output_dir={tmp_path / 'runs'}", f"name={name}",
           "action=run"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def cli(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """A login command, run from tmp_path (its default dir is tmp_path/runs)."""
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=tmp_path,
                          env=dict(ENV, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert all(f in lines[0] for f in fragments), (fragments, lines[0])
    return lines[0]


def run_to_end(tmp_path: Path, name: str, *overrides: str, env: dict | None = None) -> tuple[int, str, Path]:
    proc = launch(tmp_path, name, *overrides, env=env)
    try:
        wait_for(lambda: proc.poll() is not None, 300, f"run {name} to end", tmp_path)
        code, out = finish(proc, 60)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    (bundle,) = (tmp_path / "runs").glob(f"{name}-*")
    return code, out, bundle


def test_a_finished_run_is_listed_with_its_steps_loss_attempts_and_checkpoint(tmp_path):
    code, out, bundle = run_to_end(tmp_path, "fin", "train.train_steps=4", "checkpoint.save_at_end=true")
    assert code == 0, out[-3000:]
    listed = cli(tmp_path, "runs", "--json")
    assert listed.returncode == 0, listed.stderr
    (run,) = json.loads(listed.stdout)
    final = json.loads((bundle / "report" / "metrics.json").read_text())["final"]
    assert (run["name"], run["path"], run["state"], run["scheduler"]) == (bundle.name, str(bundle), "done", "local")
    assert (run["step"], run["total"], run["world"], run["layout"]) == (4, 4, 1, "TP1 PP1 DP1")
    assert abs(run["loss"] - final["final_loss"]) < 1e-4  # the step line prints 4 decimals
    assert run["checkpoint"] == str(bundle / "checkpoints" / "iter_0000004") and run["eta_s"] is None
    assert [(a["reached"], a["outcome"]) for a in run["attempts"]] == [(4, "done")] and run["pids"] == []

    table = cli(tmp_path, "runs").stdout.splitlines()
    assert table[0].split() == HEADER and len(table) == 2, table
    assert table[1].split() == [bundle.name, run["model"], "TP1", "PP1", "DP1", "local", "done", "4/4",
                                f"{run['loss']:.4f}", "-", "1", "iter_0000004", "-"], table

    status = cli(tmp_path, "status", "fin")  # a job name under runs/: its newest run
    assert status.returncode == 0 and f"bundle:     {bundle}\n" in status.stdout, status
    assert "state:      done\n" in status.stdout and "checkpoint: " + run["checkpoint"] in status.stdout, status.stdout
    logs = cli(tmp_path, "logs", bundle.name)
    assert re.findall(r"^step\s+(\d+) \|", logs.stdout, re.MULTILINE) == ["1", "2", "3", "4"], logs.stdout
    one_line_error(cli(tmp_path, "logs", "fin", "--rank", "1"), "--rank 1: an integer from 0 to 0", "try --rank 0")
    one_line_error(cli(tmp_path, "cancel", str(bundle)), "has already ended (done", "nothing to cancel")


def test_a_failed_run_says_why_in_one_line(tmp_path):
    # every rank's weight turns NaN before step 3 (tests/_crash_site): the loop's non-finite rule stops the run
    site = os.pathsep.join(p for p in (str(ROOT / "tests" / "_crash_site"), ENV.get("PYTHONPATH", "")) if p)
    env = dict(ENV, PYTHONPATH=site, LAUNCHER_TEST_NAN_AT_STEP="3")
    code, out, bundle = run_to_end(tmp_path, "nan", "train.train_steps=10", env=env)
    assert code != 0, out[-3000:]
    why = (bundle / "FAILED").read_text().strip()
    assert why.startswith("non-finite") and "\n" not in why, why

    status = cli(tmp_path, "status", str(bundle), "--json")
    info = json.loads(status.stdout)
    assert (info["state"], info["reason"], info["checkpoint"]) == ("failed", why, None), info
    assert info["step"] < info["total"] == 10, info
    text = cli(tmp_path, "status", "nan").stdout
    assert [line for line in text.splitlines() if line.startswith("state:")] == [f"state:      failed: {why}"], text
    listed = cli(tmp_path, "runs").stdout.splitlines()
    assert listed[1].split()[:7] == [bundle.name, info["model"], "TP1", "PP1", "DP1", "local", "failed"], listed
    one_line_error(cli(tmp_path, "cancel", "nan"), f"has already ended (failed: {why})")


def test_cancel_of_a_running_run_saves_a_checkpoint_first_then_confirms_it_ended(tmp_path):
    from launcher.run_state import live_processes

    proc = launch(tmp_path, "long", "train.train_steps=2000")
    follower = None
    try:
        bundle = wait_for(lambda: next((tmp_path / "runs").glob("long-*/config.yaml"), None), 120, "the bundle",
                          tmp_path).parent

        def running():
            info = json.loads(cli(tmp_path, "status", "long", "--json").stdout)
            return info if info["state"] == "running" and (info["step"] or 0) >= 2 else None

        info = wait_for(running, 300, "step 2 of the run", tmp_path)
        assert info["pids"] and info["total"] == 2000 and info["eta_s"] is not None and info["checkpoint"] is None
        listed = cli(tmp_path, "runs").stdout.splitlines()[1].split()
        assert listed[6] == "running" and listed[-1] == "-", listed
        follower = subprocess.Popen([sys.executable, "-m", "launcher", "logs", "long", "--follow"], cwd=tmp_path,
                                    env=dict(ENV, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)

        cancel = cli(tmp_path, "cancel", "long", timeout=900)
        assert cancel.returncode == 0, (cancel.stdout, cancel.stderr)
        said = re.fullmatch(r"cancelled (\S+): stopped at step (\d+) of 2000: SIGTERM; checkpoint (\S+)",
                            cancel.stdout.splitlines()[-1])
        assert said and said[1] == bundle.name, cancel.stdout
        step = int(said[2])
        assert step >= info["step"] and said[3] == str(bundle / "checkpoints" / f"iter_{step:07d}"), cancel.stdout
        assert json.loads((Path(said[3]) / "launcher.json").read_text())["step"] == step
        assert not live_processes().get(str(bundle)), "cancel said the run ended, yet processes of it are left"

        code, out = finish(proc, 120)  # the user's `python -m launcher` ended with the ranks' stop
        assert code == 143 and f"launcher: stopped at step {step} of 2000: SIGTERM; checkpointed" in out, out[-3000:]
        followed, err = follower.communicate(timeout=120)  # --follow ends by itself once the run has ended
        assert follower.returncode == 0 and err == "", err
        assert f"stopped at step {step} of 2000" in followed and followed.count("step     1 |") == 1, followed[-2000:]
    finally:
        for p in (proc, follower):
            if p is not None and p.poll() is None:
                kill_tree(p.pid)
    status = json.loads(cli(tmp_path, "status", "long", "--json").stdout)
    assert (status["state"], status["reason"], status["step"]) == ("stopped", f"at step {step} of 2000: SIGTERM", step)
    one_line_error(cli(tmp_path, "cancel", "long"), "has already ended (stopped: at step")


def test_bad_input_gets_one_line_naming_the_problem_and_an_alternative(tmp_path):
    rendered = cli(tmp_path, *ONE_RANK, "output_dir=runs", "name=idle", "action=render")
    assert rendered.returncode == 0, rendered.stderr
    (bundle,) = (tmp_path / "runs").glob("idle-*")
    (run,) = json.loads(cli(tmp_path, "runs", "--json").stdout)
    assert (run["state"], run["step"], run["attempts"]) == ("rendered", None, [])
    (tmp_path / "notes").mkdir()
    one_line_error(cli(tmp_path, "cancel", "idle"), "was never started", f"bash {bundle}/launch.sh")
    one_line_error(cli(tmp_path, "status", "nope"), "no run nope", f"runs there: {bundle.name}",
                   "try python -m launcher runs")
    one_line_error(cli(tmp_path, "status", "notes"), "notes is not a run bundle", "try python -m launcher runs runs")
    one_line_error(cli(tmp_path, "logs", "idle"), "no log for rank 0", "the run is rendered")
    one_line_error(cli(tmp_path, "logs", "idle", "--rank", "x"), "--rank x", "try --rank 0")
    one_line_error(cli(tmp_path, "status"), "status takes one RUN", "python -m launcher status RUN")
    one_line_error(cli(tmp_path, "status", "idle", "--jsno"), "unknown option --jsno for status",
                   "python -m launcher status RUN [--json]")
    one_line_error(cli(tmp_path, "runs", "elsewhere"), "elsewhere: no such directory", "python -m launcher runs runs")
    one_line_error(cli(tmp_path, "runs", str(bundle)), "is one run bundle", f"python -m launcher status {bundle}")
    assert cli(tmp_path, "runs", "notes").stdout == "no run bundles under notes\n"


# --- on the local Slurm cluster (tests/test_slurm_localhost.py's fixture starts it, as for every Slurm test) ------

from test_slurm_localhost import FINAL, PROFILE, job_info, slurm  # noqa: E402,F401  (the cluster fixture)


def test_cancel_of_a_slurm_job_saves_a_checkpoint_first_and_is_not_requeued(slurm, tmp_path, monkeypatch, capsys):
    """`action=submit` leaves the job id in the bundle; `runs` reads its state from Slurm; `cancel` asks the batch
    shell to stop (SIGTERM: job.sbatch's trap leaves STOP, the ranks save and exit), then scancels the job, so
    its script's requeue of a stopped run does not start it again.

    The cancel runs in this process with its final scancel held back until job.sbatch has decided what to do
    with the clean stop: the order a loaded machine produced (the script reached its `scontrol requeue` before
    cancel's poll saw STOPPED; the requeued attempt trained on). Here the script must find CANCEL and wait."""
    one_rank = ["cluster.gpus_per_node=1", "parallel.tensor=1", "parallel.pipeline=1"]
    submitted = cli(tmp_path, "recipe=smoke", *PROFILE, *one_rank, "data=mock", "train.train_steps=2000",
                    "checkpoint.save_interval=0", "slurm.time=00:30:00", "output_dir=runs", "name=sl",
                    "action=submit")
    assert submitted.returncode == 0, submitted.stderr
    job_id = re.search(r"submitted: job (\d+)", submitted.stdout)[1]
    (bundle,) = (tmp_path / "runs").glob("sl-*")
    try:
        def running():
            info = json.loads(cli(tmp_path, "status", "sl", "--json").stdout)
            assert info["state"] in ("pending", "running"), info
            return info if info["state"] == "running" and (info["step"] or 0) >= 2 else None

        info = wait_for(running, 300, f"step 2 of Slurm job {job_id}", tmp_path)
        assert (info["scheduler"], info["job_id"], info["slurm_state"]) == ("slurm", job_id, "RUNNING"), info
        row = cli(tmp_path, "runs").stdout.splitlines()[1].split()
        assert row[:8] == [bundle.name, "smoke", "TP1", "PP1", "DP1", "slurm", job_id, "running"], row

        from launcher import runs

        log = bundle / "logs" / f"slurm-{job_id}.out"
        decided = re.compile(r"launcher: (stopped .*; cancelled \(python -m launcher cancel\), not requeueing"
                             r"|stopped before the time limit .*requeueing job|failed \(exit)")
        real_scancel = runs._scancel

        def late_scancel(*args: str):
            if args == (job_id,):  # the scancel that ends the job: only once the script has decided
                wait_for(lambda: log.is_file() and decided.search(log.read_text()), 300,
                         f"job.sbatch's decision after the stop in {log}", bundle)
            return real_scancel(*args)

        monkeypatch.setattr(runs, "_scancel", late_scancel)
        monkeypatch.chdir(tmp_path)
        code = runs.main(["cancel", "sl"])
        out, err = capsys.readouterr()
        assert code == 0, (out, err)
        assert "cancelled (python -m launcher cancel), not requeueing" in log.read_text(), log.read_text()
        said = re.fullmatch(r"cancelled \S+: stopped at step (\d+) of 2000: STOP file; checkpoint (\S+)",
                            out.splitlines()[-1])
        assert said, out
        step = int(said[1])
        assert said[2] == str(bundle / "checkpoints" / f"iter_{step:07d}") and step >= info["step"], cancel.stdout
        assert json.loads((Path(said[2]) / "launcher.json").read_text())["step"] == step
        final = job_info(job_id)
        assert final["JobState"] == "CANCELLED" and final["Restarts"] == "0", final  # ended, not requeued
    finally:
        if job_info(job_id).get("JobState") not in FINAL:
            subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    status = json.loads(cli(tmp_path, "status", str(bundle), "--json").stdout)
    assert (status["state"], status["slurm_state"], status["step"]) == ("stopped", "CANCELLED", step), status
    one_line_error(cli(tmp_path, "cancel", "sl"), "has already ended (stopped: at step")


def test_cancel_of_a_pending_slurm_job_only_cancels_it(slurm, tmp_path):
    """A job that has not started (here: --begin an hour away) has nothing to save: scancel, and say so."""
    submitted = cli(tmp_path, "recipe=smoke", *PROFILE, "data=mock", "output_dir=runs", "name=later",
                    "slurm.time=00:30:00", "slurm.extra_args=['--begin=now+3600']", "action=submit")
    assert submitted.returncode == 0, submitted.stderr
    job_id = re.search(r"submitted: job (\d+)", submitted.stdout)[1]
    try:
        (run,) = json.loads(cli(tmp_path, "runs", "--json").stdout)
        assert (run["state"], run["slurm_state"], run["job_id"], run["step"]) == ("pending", "PENDING", job_id, None)
        cancel = cli(tmp_path, "cancel", "later")
        assert cancel.returncode == 0 and cancel.stdout == \
            f"cancelled {Path(run['path']).name}: job {job_id} had not started (CANCELLED)\n", cancel
        assert job_info(job_id)["JobState"] == "CANCELLED"
    finally:
        if job_info(job_id).get("JobState") not in FINAL:
            subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    (run,) = json.loads(cli(tmp_path, "runs", "--json").stdout)
    assert (run["state"], run["reason"]) == ("cancelled", "slurm: CANCELLED"), run
    one_line_error(cli(tmp_path, "cancel", "later"), "has already ended (cancelled: slurm: CANCELLED)")
