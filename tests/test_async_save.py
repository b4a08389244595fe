"""checkpoint.async_save (launcher/rank/checkpoint/async_save.py): a stop signal during an asynchronous write, and the login
side's view of it (the stop lead, the plan). The kill -9 during a write, the losses against a synchronous run and
pruning with keep_last=1 are the async case of tests/test_train_resume.py."""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from _rank_harness import TINY, _start, kill_tree, layout, rank_log_tails, write_bundle

ROOT = Path(__file__).resolve().parents[1]
CRASH_SITE = str(ROOT / "tests" / "_crash_site")


def _signal_ranks(torchrun_pid: int, sig: int) -> int:
    """``sig`` to every process under torchrun (its ranks and their writers: what scancel reaches besides
    torchrun); returns how many were signalled."""
    import psutil

    sent = 0
    for proc in psutil.Process(torchrun_pid).children(recursive=True):
        try:
            proc.send_signal(sig)
            sent += 1
        except psutil.NoSuchProcess:
            pass
    return sent


def test_sigterm_during_an_async_write_publishes_it_then_saves_the_stop_checkpoint(tmp_path):
    """SIGTERM while step 2's checkpoint is written in the background (its writer slowed by tests/_crash_site):
    the ranks stop at the next step boundary, wait for the write in flight to be published, then save the stop
    checkpoint; both are complete, in that order, and the stop checkpoint is the newest."""
    bundle = write_bundle(tmp_path / "term", TINY + layout() + ["train.train_steps=200", "checkpoint.save_interval=2",
                                                                 "checkpoint.async_save=true"], 2)
    ckpt = bundle / "checkpoints"
    env = {"PYTHONPATH": os.pathsep.join(p for p in (CRASH_SITE, os.environ.get("PYTHONPATH", "")) if p),
           "LAUNCHER_TEST_SLOW_ASYNC_WRITE": "2:6"}
    _, proc = _start(["-m", "launcher.rank", "--bundle", str(bundle)], 2, env)
    watchdog = threading.Timer(600, kill_tree, args=(proc.pid,))  # a hang detector only
    watchdog.start()
    lines, signalled = [], 0
    try:
        for line in proc.stdout:
            lines.append(line)
            if not signalled and f"writing checkpoint {ckpt / 'iter_0000002'} in the background" in line:
                signalled = _signal_ranks(proc.pid, signal.SIGTERM)
        proc.wait()
    finally:
        watchdog.cancel()
        kill_tree(proc.pid)
    out = "".join(lines)
    assert signalled >= 2, out[-3000:]
    assert proc.returncode == 0, f"{out[-3000:]}\n{rank_log_tails(bundle)}"
    stopped = [line for line in lines if line.startswith("stopped at step ")]
    assert len(stopped) == 1 and "(checkpointed; a requeued run resumes)" in stopped[0], out[-3000:]
    stop_step = int(stopped[0].split()[3])
    assert stop_step > 2, out[-3000:]
    saved = [line.split()[-1] for line in lines if line.startswith("saved checkpoint ")]
    assert saved == [str(ckpt / "iter_0000002"), str(ckpt / f"iter_{stop_step:07d}")], out[-3000:]
    for step in (2, stop_step):
        assert (ckpt / f"iter_{step:07d}" / "launcher.json").is_file()
    assert (ckpt / "latest").read_text().strip() == f"iter_{stop_step:07d}"
    assert not list(ckpt.glob("*.tmp"))


def test_the_stop_lead_counts_a_save_in_flight():
    """A stop that finds an asynchronous save in flight waits for it, then saves: one more factor x save."""
    from launcher.core.signal_lead import StopGuard, needed_s

    assert needed_s(100, 10, factor=1.5, margin_s=60) == 220
    assert needed_s(100, 10, factor=1.5, margin_s=60, in_flight=True) == 370
    guard = StopGuard(job_end=1000.0, save_s=100, factor=1.5, margin_s=60, clock=lambda: 1000.0 - 300)
    assert guard.reason() is None
    guard.in_flight = True
    assert guard.reason() is not None


def test_render_derives_a_longer_lead_and_the_plan_counts_host_memory_for_async_save():
    from launcher.config import compose_job
    from launcher.core.signal_lead import lead_for_render
    from launcher.plan import plan_job

    base = ["recipe=llama3_8b", "nodes=1"]
    jobs = {flag: compose_job([*base, f"checkpoint.async_save={flag}"]) for flag in ("false", "true")}
    plans = {flag: plan_job(job).to_dict() for flag, job in jobs.items()}
    leads = {flag: lead_for_render(job, 4 * 3600, plans[flag]) for flag, job in jobs.items()}
    assert leads["true"]["seconds"] > leads["false"]["seconds"] and leads["true"]["async_save_in_flight"]
    saving = plans["true"]["checkpoint"]
    assert "checkpoint" not in plans["false"]
    # each rank holds a copy of its shards in host memory: the checkpoint's bytes over the ranks
    job = jobs["true"]
    assert saving["host_bytes_per_rank"] * job.cluster.gpus_per_node == pytest.approx(saving["host_bytes_per_node"])
    assert saving["host_bytes_per_node"] == pytest.approx(saving["bytes"] / job.nodes)
    assert saving["hidden_s"] == saving["save_s"] > 0
