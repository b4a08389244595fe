"""Checkpoint bookkeeping without training (one process, no process group): what counts as a checkpoint,
newest-first listing, pruning, verification, run identity and the resume decision (the torch-free
``launcher/core/checkpoint/directory.py`` and ``run_identity.py``), the directory lock and the ranks' refusals
(``launcher/rank/checkpoint/store.py``)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from launcher.config import compose_job
from launcher.core.checkpoint import directory as cd
from launcher.core.run_identity import identity_diff, run_hash, run_identity
from launcher.core.checkpoint.weights import weights_mismatch
from launcher.rank.checkpoint import store as ckpt
from launcher.rank.loop import straggler_report


def _fake(root, step, run="r1", files=None, manifest=True, identity=None):
    path = root / f"iter_{step:07d}"
    path.mkdir(parents=True)
    files = files or {"__0_0.distcp": b"x" * 10, "metadata.json": b"{}"}
    for name, data in files.items():
        (path / name).write_bytes(data)
    if manifest:
        rec = {n: {"size": len(d), "crc32": __import__("zlib").crc32(d)} for n, d in files.items()}
        (path / cd.MANIFEST).write_text(json.dumps({"step": step, "run": run, "identity": identity or {},
                                                      "files": rec}))
    return path


def test_only_directories_with_a_manifest_count_newest_first(tmp_path):
    _fake(tmp_path, 2)
    _fake(tmp_path, 10)
    _fake(tmp_path, 4)
    _fake(tmp_path, 12, manifest=False)           # a partial directory (crash before publication)
    (tmp_path / "iter_0000014.tmp").mkdir()        # a save in progress
    (tmp_path / "latest").write_text("iter_0000012\n")  # a stale or lying `latest` is only a hint
    assert [p.name for p, _ in cd.complete_checkpoints(tmp_path)] == ["iter_0000010", "iter_0000004",
                                                                        "iter_0000002"]
    assert cd.latest_checkpoint(tmp_path).name == "iter_0000010"
    assert cd.complete_checkpoints(tmp_path / "absent") == []


def test_prune_keeps_the_newest_and_ignores_partial_and_foreign(tmp_path):
    for step in (1, 2, 3):
        _fake(tmp_path, step)
    _fake(tmp_path, 4, manifest=False)   # stray partial dir: neither counted nor deleted
    _fake(tmp_path, 5, run="other")      # another run's checkpoint: never deleted
    cd.prune(tmp_path, 1, "r1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "iter_0000004", "iter_0000005"]
    cd.prune(tmp_path, 0, "r1")  # keep_last unset/0: keep all
    assert (tmp_path / "iter_0000003").exists()


def test_verify_catches_truncation_missing_files_and_bit_flips(tmp_path):
    path = _fake(tmp_path, 1, files={"__0_0.distcp": b"a" * 100, "__1_0.distcp": b"b" * 100,
                                     "metadata.json": b"{}"})
    manifest = cd.read_manifest(path)
    assert cd.verify_files(path, manifest, checksum=True) == []
    (path / "__0_0.distcp").write_bytes(b"a" * 50)
    (path / "metadata.json").unlink()
    (path / "__1_0.distcp").write_bytes(b"c" * 100)  # same size, other bytes
    sizes = cd.verify_files(path, manifest, checksum=False)
    assert sizes == ["__0_0.distcp has 50 bytes, 100 were written", "metadata.json is missing"]
    assert "__1_0.distcp fails its CRC32 check" in cd.verify_files(path, manifest, checksum=True)
    # spread over ranks: the shares partition the files
    shares = [cd.verify_files(path, manifest, checksum=True, rank=r, world=2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(cd.verify_files(path, manifest, checksum=True))


def test_lock_refuses_a_live_owner_and_takes_a_dead_ones(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / ckpt.LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": other.pid, "job": "",
                                                      "bundle": "/runs/a", "since": "t"}))
        lock = ckpt.DirLock(tmp_path, bundle=tmp_path / "b", run="r2")
        with pytest.raises(ckpt.CheckpointError, match=r"is in use by another run \(pid \d+ on .*bundle /runs/a"):
            lock.acquire()
    finally:
        other.kill()
        other.wait()
    lock.acquire()  # its owner is gone: stale, taken over
    assert json.loads((tmp_path / ckpt.LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / ckpt.LOCK).exists()


def test_a_second_run_stops_at_the_lock_before_building_its_model(tmp_path, monkeypatch):
    """The lock is taken right after the process group, before the model build (~60 s on a real job): a run
    whose checkpoint dir is held stops with the lock's line and never reaches the build."""
    import models
    from launcher.config import job_to_yaml
    from launcher.rank import entry, setup

    job = compose_job(["recipe=smoke", f"checkpoint.dir={tmp_path / 'ckpt'}"])
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.yaml").write_text(job_to_yaml(job))
    monkeypatch.setattr(setup, "init_distributed", lambda **kw: None)

    def build(**kw):
        raise AssertionError("the model was built before the lock was taken")

    monkeypatch.setattr(models, "build_model", build)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / ckpt.LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": other.pid,
                                                               "job": "", "bundle": "/runs/first"}))
        with pytest.raises(entry.RunRefused, match=r"is in use by another run .*bundle /runs/first"):
            entry.train(bundle, console=None)
    finally:
        other.kill()
        other.wait()


def test_lock_staleness_rules(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert ckpt.lock_is_stale({"host": "elsewhere", "pid": 1, "job": "77"}, 0)       # this job, requeued
    assert not ckpt.lock_is_stale({"host": "elsewhere", "pid": 1, "job": "78"}, 10)  # another node, fresh
    assert ckpt.lock_is_stale({"host": "elsewhere", "pid": 1, "job": "78"}, ckpt.LOCK_STALE_S + 1)
    assert not ckpt.lock_is_stale({"host": socket.gethostname(), "pid": 1, "job": ""}, 0)  # pid 1 lives


def test_identity_ignores_launch_details_but_not_the_run():
    base = run_identity(compose_job(["recipe=smoke"]))
    same = run_identity(compose_job(["recipe=smoke", "train.train_steps=99", "checkpoint.save_interval=5",
                                          "output_dir=/elsewhere", "logging.tensorboard=false",
                                          "data.num_workers=0", "slurm.time=01:00:00"]))
    assert run_hash(base) == run_hash(same)
    other = run_identity(compose_job(["recipe=smoke", "train.seed=7"]))
    assert run_hash(base) != run_hash(other)
    assert identity_diff(other, base) == "train.seed=7 there, 1234 here"
    layout = run_identity(compose_job(["recipe=smoke", "parallel.tensor=1"]))
    assert run_hash(layout) != run_hash(base)  # a layout change needs checkpoint.load=


def test_resume_plan_refuses_other_runs_and_unmanifested_dirs(tmp_path):
    ours = {"train.seed": 1}
    assert cd.plan_resume(tmp_path, ours, None) == {"candidates": [], "source": "dir"}  # empty: fresh
    foreign = _fake(tmp_path, 5, run=run_hash({"train.seed": 2}), identity={"train.seed": 2})
    plan = cd.plan_resume(tmp_path, ours, None)
    assert plan["error"] == (f"checkpoint.dir={tmp_path} holds checkpoints of another run (iter_0000005: "
                             f"train.seed=2 there, 1 here); use checkpoint.load={foreign} to start from it, "
                             "or another checkpoint.dir")
    assert [p for p, _ in cd.plan_resume(tmp_path, ours, str(foreign))["candidates"]] == [str(foreign)]
    assert [p for p, _ in cd.plan_resume(tmp_path / "x", ours, str(tmp_path))["candidates"]] == [str(foreign)]
    assert "no complete checkpoint there" in cd.plan_resume(tmp_path / "x", ours, str(tmp_path / "y"))["error"]
    own = _fake(tmp_path, 3, run=run_hash(ours))  # this run's own checkpoints win over checkpoint.load
    assert [p for p, _ in cd.plan_resume(tmp_path, ours, str(foreign))["candidates"]] == [str(own)]
    legacy = tmp_path / "legacy"
    _fake(legacy, 9, manifest=False)
    assert "without launcher.json" in cd.plan_resume(legacy, ours, None)["error"]
    # named explicitly, such a checkpoint is loaded (nothing recorded to verify it against)
    assert cd.plan_resume(tmp_path / "x", ours, str(legacy / "iter_0000009"))["candidates"] == [
        (str(legacy / "iter_0000009"), {"files": {}, "step": None})]


def test_another_models_checkpoints_are_not_offered_to_checkpoint_load(tmp_path):
    """After model.hidden_size changed, the refusal used to print checkpoint.load=<it>, which then failed with an
    opaque CheckpointException and a 'fix or remove them' about a healthy directory (issue 27 item 3)."""
    theirs = run_identity(compose_job(["recipe=smoke", "model.hidden_size=64"]))
    ours = run_identity(compose_job(["recipe=smoke"]))
    saved = _fake(tmp_path, 5, run=run_hash(theirs), identity=theirs)
    assert cd.plan_resume(tmp_path, ours, None)["error"] == (
        f"checkpoint.dir={tmp_path} holds checkpoints of another model (iter_0000005: model.hidden_size=64 there, "
        "128 here): their weights cannot be loaded into this one; use another checkpoint.dir, or set "
        "model.hidden_size=64 to continue that run")
    with pytest.raises(ckpt.CheckpointError) as refused:
        ckpt.resume(tmp_path / "fresh", identity=ours, load_from=str(saved), checksum=False, model=None,
                    optimizer=None, scheduler=None, warn=print)
    assert str(refused.value) == (f"checkpoint.load={saved}: its weights are of another model (model.hidden_size=64 "
                                  "there, 128 here); name a checkpoint of this model, or set model.hidden_size=64")
    # a layout or training change is another run but the same weights: checkpoint.load= is still the way
    relaid = run_identity(compose_job(["recipe=smoke", "parallel.tensor=1", "train.lr=1e-3"]))
    other_run = tmp_path / "other_run"
    _fake(other_run, 2, run=run_hash(ours), identity=ours)
    assert "; use checkpoint.load=" in cd.plan_resume(other_run, relaid, None)["error"]
    assert weights_mismatch({"identity": theirs}, theirs) is None
    assert weights_mismatch({"identity": ours}, relaid) is None


def test_set_aside_moves_only_this_runs_checkpoints(tmp_path):
    _fake(tmp_path, 4, run="r1")
    _fake(tmp_path, 8, run="r2")
    (tmp_path / "latest").write_text("iter_0000004\n")
    moved = cd.set_aside(tmp_path, "r1")
    assert [p.name.endswith("-iter_0000004") for p in moved] == [True]
    assert [p.name for p, _ in cd.complete_checkpoints(tmp_path)] == ["iter_0000008"]
    assert not (tmp_path / "latest").exists()


def test_preflight_reports_unwritable_and_full_dirs(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint.dir=/proc/x is not writable"):
        ckpt.preflight_dir(__import__("pathlib").Path("/proc/x"), 1)
    with pytest.raises(ckpt.CheckpointError, match=r"not enough space for a checkpoint: .* GB free, one needs about"):
        ckpt.preflight_dir(tmp_path, 1 << 60)
    ckpt.preflight_dir(tmp_path / "new", 1)
    assert list((tmp_path / "new").iterdir()) == []  # the probe is removed


def test_enospc_is_found_through_wrapped_errors():
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError as inner:
            raise RuntimeError("worker failed") from inner
    except RuntimeError as exc:
        assert cd.mentions_enospc(exc)
    assert not cd.mentions_enospc(RuntimeError("other"))


def test_straggler_report_names_the_slow_rank():
    assert straggler_report([100, 101, 99, 100], 0.2) == "step ms per rank: 0:100 1:101 2:99 3:100"
    line = straggler_report([100, 100, 180, 100], 0.2)
    assert line.endswith("straggler: rank 2 at 180 ms is 80% slower than the median 100 ms"), line


def test_local_run_refuses_an_unwritable_or_full_checkpoint_dir_on_the_login_node(tmp_path):
    from conftest import ROOT

    def run(*overrides):
        return subprocess.run([sys.executable, "-m", "launcher", *overrides, f"output_dir={tmp_path / 'runs'}",
                               "action=run"], cwd=ROOT, capture_output=True, text=True, timeout=120)

    proc = run("checkpoint.dir=/proc/x/ckpt")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("error: checkpoint.dir='/proc/x/ckpt': not writable (a test file "
                                                    "in /proc: No such file or directory); try a directory you can "
                                                    "write to, or checkpoint.dir=null (inside the run's bundle)"), \
        proc.stderr
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)]).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        proc = run(f"checkpoint.dir={small / 'ckpt'}")
    finally:
        subprocess.run(["umount", str(small)])
    assert proc.returncode == 2
    assert "not enough space for a checkpoint" in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert "launcher.rank.agent" not in proc.stdout  # refused before anything started
