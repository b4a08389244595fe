"""pytest plugin of the GPU lane (tests/gpu/lane.py passes ``-p _lane_plugin``): each check's outcome is appended to
$LAUNCHER_GPU_LANE_OUT/results.jsonl the moment it is known, so a lane stopped by its budget still reports what
finished (pytest's own JUnit file is written only at the end)."""
from __future__ import annotations

import json
import os
from pathlib import Path


def pytest_runtest_logreport(report):
    out = os.environ.get("LAUNCHER_GPU_LANE_OUT")
    if not out or (report.when != "call" and report.outcome == "passed"):
        return
    if report.when == "call" or report.outcome != "passed":  # a skip or failure in setup ends the test there
        message = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            message = str(report.longrepr[2])
        elif report.failed:  # the assertion's own line (pytest's crash summary), else the report's last line
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else (str(report.longreprtext).strip().splitlines() or [""])[-1]
        row = {"test": report.nodeid.split("::", 1)[-1], "outcome": "error" if report.failed and report.when != "call"
               else report.outcome, "seconds": round(report.duration, 1), "message": message[:300]}
        with open(Path(out) / "results.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
