"""The suite stops what it started of the local Slurm cluster, and nothing else (conftest.stop_started_slurm and
slurm/localhost/stop.sh with a list of daemons), shown on stand-in daemons: copies of `sleep` named slurmd and
slurmctld, with PID files in a private SLURM_LOCAL_DIR, and stand-in squeue/scontrol on PATH."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import _slurm_daemons_alive, stop_started_slurm


@pytest.fixture
def fake_cluster(tmp_path, monkeypatch):
    state, bin_dir = tmp_path / "state", tmp_path / "bin"
    state.mkdir()
    bin_dir.mkdir()
    procs = {}
    for name in ("slurmd", "slurmctld"):
        exe = bin_dir / name
        shutil.copy(shutil.which("sleep"), exe)  # /proc/PID/comm is then the daemon's name
        procs[name] = subprocess.Popen([str(exe), "300"])
        (state / f"{name}.pid").write_text(f"{procs[name].pid}\n")
    (bin_dir / "scontrol").write_text("#!/bin/sh\nexit 1\n")  # ping: not up (stop.sh cancels nothing)
    queue = tmp_path / "queue"
    queue.write_text("")
    (bin_dir / "squeue").write_text(f"#!/bin/sh\ncat {queue}\n")
    for tool in ("scontrol", "squeue"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("SLURM_LOCAL_DIR", str(state))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    deadline = time.monotonic() + 30  # a hang detector: the copies start at once
    while {"slurmd", "slurmctld"} - _slurm_daemons_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    yield procs, queue
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_stops_only_the_daemons_this_session_started(fake_cluster):
    procs, _ = fake_cluster
    assert {"slurmd", "slurmctld"} <= _slurm_daemons_alive()
    said = stop_started_slurm({"slurmd"})  # slurmctld was running before the session: not ours
    assert "stopping slurmd" in said, said
    assert procs["slurmd"].wait(timeout=30) is not None  # a hang detector on the stop, not a speed bound
    assert procs["slurmctld"].poll() is None
    assert _slurm_daemons_alive() & {"slurmd", "slurmctld"} == {"slurmctld"}
    assert stop_started_slurm(set()) == "nothing to stop"
    assert procs["slurmctld"].poll() is None


def test_leaves_the_cluster_running_while_other_jobs_are_queued(fake_cluster):
    procs, queue = fake_cluster
    queue.write_text("4242\n")
    said = stop_started_slurm({"slurmd", "slurmctld"})
    assert said == "left running: jobs 4242 are queued", said
    assert procs["slurmd"].poll() is None and procs["slurmctld"].poll() is None


def test_stop_script_refuses_an_unknown_daemon_name():
    stop = Path(__file__).resolve().parents[1] / "slurm" / "localhost" / "stop.sh"
    proc = subprocess.run(["bash", str(stop), "slurmdbd"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "slurm-localhost: error: unknown daemon 'slurmdbd' (slurmd, slurmctld, munged)"
