"""The checkpoint directory's LOCK never has two holders (issue 27 item 1).

Eight contender processes start together (a barrier), round after round, each calling the production
``launcher.core.checkpoint.dirlock.take`` with the production staleness rule; every round must end with exactly one holder,
and the LOCK on disk must be that holder's. Rounds cycle through a free directory, a LOCK whose owner is dead (a
crashed run on this host: every contender wants to replace it at once) and an old torn (empty) LOCK. Before the
fix (O_EXCL create, then the owner written; a reader of the empty file called it stale and replaced it) the same
race saw two holders in about one round in three.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import uuid

from launcher.core.checkpoint import dirlock

CONTENDERS = 8
ROUNDS = 300
STALE_S = 600.0


def _owner(i: int) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": "", "bundle": f"/runs/c{i}", "run": "r",
            "token": uuid.uuid4().hex}


def _contender(i, path, start, checked, cleared, results, rounds):
    def gone(owner, age):
        return dirlock.owner_gone(owner, age, stale_s=STALE_S)

    for _ in range(rounds):
        start.wait()
        me = _owner(i)
        try:
            holder = dirlock.take(path, me, gone)
            results.put((i, holder is None, me["token"], None))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the test
            holder = "error"
            results.put((i, False, me["token"], repr(exc)))
        checked.wait()
        if holder is None:
            dirlock.release(path, me)
        cleared.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_simultaneous_contenders_never_both_hold_the_lock(tmp_path):
    path = tmp_path / "ckpt" / "LOCK"
    path.parent.mkdir()
    ctx = multiprocessing.get_context("fork")
    start, checked, cleared = (ctx.Barrier(CONTENDERS + 1, timeout=120) for _ in range(3))
    results = ctx.Queue()
    procs = [ctx.Process(target=_contender, args=(i, path, start, checked, cleared, results, ROUNDS), daemon=True)
             for i in range(CONTENDERS)]
    for p in procs:
        p.start()
    dead = _dead_pid()
    bad = []
    try:
        for rnd in range(ROUNDS):
            kind = ("free", "dead owner", "torn and old")[rnd % 3]
            if kind == "dead owner":
                path.write_text(json.dumps({"host": socket.gethostname(), "pid": dead, "job": "", "since": "t"}))
            elif kind == "torn and old":
                path.write_text("")
                os.utime(path, (time.time() - 3600, time.time() - 3600))
            start.wait()
            got = [results.get(timeout=120) for _ in range(CONTENDERS)]
            errors = [e for *_, e in got if e]
            holders = [(i, token) for i, held, token, _ in got if held]
            on_disk = json.loads(path.read_text()).get("token") if path.exists() else None
            if errors or len(holders) != 1 or on_disk != holders[0][1]:
                bad.append((rnd, kind, len(holders), errors[:1]))
            checked.wait()
            cleared.wait()
            assert not path.exists(), f"round {rnd}: the holder's release left {path}"
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    assert not bad, f"{len(bad)} of {ROUNDS} rounds without exactly one holder, e.g. {bad[:3]}"
    assert not [p.name for p in path.parent.iterdir() if p.name not in ("LOCK.guard",)], \
        "temporary owner files left behind"


def test_a_live_holder_is_named_and_kept(tmp_path):
    path = tmp_path / "LOCK"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        theirs = {"host": socket.gethostname(), "pid": other.pid, "job": "", "bundle": "/runs/a", "token": "x"}
        assert dirlock.take(path, theirs, lambda o, a: False) is None
        holder = dirlock.take(path, _owner(1), lambda o, a: dirlock.owner_gone(o, a, stale_s=STALE_S))
        assert holder["pid"] == other.pid and holder["bundle"] == "/runs/a"
        dirlock.release(path, _owner(1))  # not ours: left alone
        assert json.loads(path.read_text())["token"] == "x"
    finally:
        other.kill()
        other.wait()
    assert dirlock.take(path, _owner(2), lambda o, a: dirlock.owner_gone(o, a, stale_s=STALE_S)) is None


def test_a_young_unreadable_lock_counts_as_held(tmp_path):
    """The fallback writer (no hard links) creates, then writes: an empty LOCK seconds old is somebody's."""
    path = tmp_path / "LOCK"
    path.write_text("")
    assert dirlock.take(path, _owner(1), lambda o, a: True) == {}
    os.utime(path, (time.time() - 3600, time.time() - 3600))
    assert dirlock.take(path, _owner(1), lambda o, a: True) is None


def test_without_hard_links_the_exclusive_create_still_has_one_holder(tmp_path, monkeypatch):
    import errno

    def no_link(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(dirlock.os, "link", no_link)
    path = tmp_path / "LOCK"
    assert dirlock.take(path, _owner(1), lambda o, a: False) is None
    assert dirlock.take(path, _owner(2), lambda o, a: False)["bundle"] == "/runs/c1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LOCK", "LOCK.guard"]
