"""Every job of the GPU lane (tests/gpu/jobs.py) composes, validates and renders on the login node (no GPU),
and the lane's tests are collected and skipped cleanly here."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import jobs  # noqa: E402


@pytest.mark.parametrize("name", sorted(jobs.ALL))
def test_gpu_lane_job_validates_and_renders(cli, tmp_path, name):
    code, out, err = cli(*jobs.ALL[name], "action=render", f"output_dir={tmp_path}")
    assert code == 0, f"{name}: {err or out}"


def test_gpu_lane_is_collected_and_skips_without_cuda():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/gpu"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "skipped" in proc.stdout and "failed" not in proc.stdout and "error" not in proc.stdout.lower()


# ---------------------------------------------------------------------------------- the lane's driver, on CPU
import json  # noqa: E402
import os  # noqa: E402

import lane  # noqa: E402

CHECKS = '''
import os, subprocess, sys, time
import pytest
sys.path.insert(0, {gpu!r})
from test_first_node import record

def test_passes():
    record("passes", ratio=0.97)

def test_fails():
    assert 1 == 2, "one is not two"

def test_skips():
    pytest.skip("needs 8 GPUs on this node, has 0")

def test_hangs(tmp_path):
    if not os.environ.get("HANG"):
        return
    # a job in a session of its own, its command line naming its directory (as launch.sh and torchrun name the bundle)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", str(tmp_path)], start_new_session=True)
    time.sleep(300)
'''


def _checks(tmp_path):
    path = tmp_path / "lane_checks.py"
    path.write_text(CHECKS.format(gpu=str(ROOT / "tests" / "gpu")))
    return path


def test_lane_refuses_a_machine_without_cuda_in_one_line():
    proc = subprocess.run([sys.executable, "tests/gpu/lane.py"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["gpu lane: cannot run here: no CUDA device visible "
                                                "(torch.cuda.is_available() is False)"]


def test_lane_report_lists_every_check_with_its_measurements(tmp_path):
    report = lane.lane(tmp_path / "out", tests=_checks(tmp_path), budget_s=300)
    outcome = {c["test"]: c["outcome"] for c in report["checks"]}
    assert outcome == {"test_passes": "passed", "test_fails": "failed", "test_skips": "skipped",
                       "test_hangs": "passed"}
    assert not report["ok"] and not report["timed_out"]
    assert report["measurements"] == {"passes": [{"ratio": 0.97}]}
    assert "one is not two" in next(c["message"] for c in report["checks"] if c["test"] == "test_fails")
    assert "needs 8 GPUs" in next(c["message"] for c in report["checks"] if c["test"] == "test_skips")
    saved = json.loads((tmp_path / "out" / "gpu-lane-report.json").read_text())
    assert saved["checks"] == report["checks"] and saved["machine"]["python"]
    text = (tmp_path / "out" / "gpu-lane-report.txt").read_text()
    assert text.startswith("GPU lane FAILED") and "test_fails" in text and 'passes: {"ratio": 0.97}' in text
    # the same checks without the failing one: the lane passes (skips do not fail it)
    assert lane.lane(tmp_path / "out2", tests=_checks(tmp_path), budget_s=300, select="not fails")["ok"]


def test_lane_stops_at_its_budget_and_reports_what_finished(tmp_path, monkeypatch):
    monkeypatch.setenv("HANG", "1")
    report = lane.lane(tmp_path / "out", tests=_checks(tmp_path), budget_s=20, select="passes or hangs")
    assert report["timed_out"] and not report["ok"] and report["elapsed_s"] < 120
    assert [c["test"] for c in report["checks"]] == ["test_passes"]  # the hung check never finished
    assert "budget exceeded" in (tmp_path / "out" / "gpu-lane-report.txt").read_text()
    runs = str(tmp_path / "out" / "runs")
    left = [p for p in os.listdir("/proc") if p.isdigit() and runs in _cmdline(p)]
    assert not left, "a job the hung check started outlived the lane"


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
