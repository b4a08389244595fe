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
