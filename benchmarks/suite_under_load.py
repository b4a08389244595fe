"""The test suite under load: `make test` (or another target) while a second process keeps the cores busy with a
loop of `python -m launcher` smoke runs (the embedded default: a tiny real TP2 x PP2 training run on this node).
Reports, per repetition, pass/fail, the wall time, the pytest summary line and the load average, and how many
smoke runs the load loop finished meanwhile. Exit code 0 only if every repetition passed.

    .venv/bin/python benchmarks/suite_under_load.py                 # make test once, under load
    .venv/bin/python benchmarks/suite_under_load.py --repeat 3      # issue 25's acceptance: three in a row
    .venv/bin/python benchmarks/suite_under_load.py --target test-fast --loaders 2
    .venv/bin/python benchmarks/suite_under_load.py --no-load       # the same figure on an idle machine

Each repetition's full output goes to runs/suite_under_load/<UTC time>-<target>-<i>.log. The smoke runs write
their bundles to a temporary directory that is removed at the end; the load loop (its own process group) is
stopped when the suite ends, also on Ctrl-C.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = ROOT / ".venv" / "bin" / "python"
SUMMARY = re.compile(r"^=*\s*(?:\d+ (?:passed|failed|error|errors|skipped|deselected|xfailed|xpassed|warnings?)"
                     r"[ ,]*)+.* in [\d.]+s.*$", re.MULTILINE)

LOAD_LOOP = r"""
import os, signal, subprocess, sys, tempfile
out, python = sys.argv[1], sys.argv[2]
n = ok = 0
child = [None]


def stop(*_):
    # the launcher ends its run (launch.sh's group and any strays) on SIGINT, as on Ctrl-C
    if child[0] is not None and child[0].poll() is None:
        child[0].send_signal(signal.SIGINT)
        try:
            child[0].wait(60)
        except subprocess.TimeoutExpired:
            child[0].kill()
    sys.exit(0)


signal.signal(signal.SIGTERM, stop)
# started from a background shell, SIGINT arrives ignored and exec keeps it so: the smoke launchers would ignore
# the Ctrl-C that stops them; a handler here is reset to the default in each child, as in a terminal
signal.signal(signal.SIGINT, signal.default_int_handler)
while True:
    with tempfile.TemporaryDirectory(dir=out) as d:
        child[0] = subprocess.Popen([python, "-m", "launcher", f"output_dir={d}"], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        rc = child[0].wait()
    n, ok = n + 1, ok + (rc == 0)
    with open(os.path.join(out, "count"), "w") as f:
        f.write(f"{n} {ok}\n")
"""


def start_load(loaders: int, scratch: Path) -> list[subprocess.Popen]:
    python = str(PY if PY.exists() else sys.executable)
    procs = []
    for i in range(loaders):
        d = scratch / f"loader{i}"
        d.mkdir()
        procs.append(subprocess.Popen([python, "-c", LOAD_LOOP, str(d), python], cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True))
    return procs


def stop_load(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each loop, which stops its smoke run the way Ctrl-C does (the launcher then ends launch.sh's group
    and its strays); a loop still there after 120 s loses its process group to SIGKILL."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def smoke_runs(scratch: Path) -> tuple[int, int]:
    n = ok = 0
    for count in scratch.glob("loader*/count"):
        a, b = count.read_text().split()
        n, ok = n + int(a), ok + int(b)
    return n, ok


def run_target(target: str, log: Path) -> tuple[int, float, str]:
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.run(["make", target], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    text = log.read_text(errors="replace")
    found = SUMMARY.findall(text)
    return proc.returncode, wall, (found[-1].strip("= ") if found else "(no pytest summary line)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="test", help="the make target to run (default: test)")
    parser.add_argument("--repeat", type=int, default=1, help="repetitions in a row (default 1)")
    parser.add_argument("--loaders", type=int, default=1,
                        help="parallel smoke-run loops (default 1: its 4 ranks keep 2 cores busy)")
    parser.add_argument("--no-load", action="store_true", help="run the target without the load loop")
    args = parser.parse_args()

    logs = ROOT / "runs" / "suite_under_load"
    logs.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="suite_load_"))
    procs = [] if args.no_load else start_load(args.loaders, scratch)
    results = []
    try:
        if procs:
            time.sleep(5)  # the first smoke run is under way before the suite starts
        for i in range(1, args.repeat + 1):
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            log = logs / f"{stamp}-{args.target}-{i}.log"
            load0 = os.getloadavg()[0]
            code, wall, summary = run_target(args.target, log)
            load1 = os.getloadavg()[0]
            n, ok = smoke_runs(scratch)
            verdict = "PASS" if code == 0 else f"FAIL (make exit {code})"
            results.append(code == 0)
            print(f"run {i}/{args.repeat}: make {args.target}: {verdict} in {wall / 60:.1f} min ({wall:.0f} s); "
                  f"{summary}; load average {load0:.1f} at start, {load1:.1f} at end; smoke runs under way so "
                  f"far: {n} finished, {ok} ok; log {log.relative_to(ROOT)}", flush=True)
    finally:
        stop_load(procs)
        shutil.rmtree(scratch, ignore_errors=True)
    cores = os.cpu_count()
    print(f"{sum(results)}/{len(results)} passed ({'with' if procs else 'without'} load: {len(procs)} smoke-run "
          f"loop(s) on {cores} cores)")
    return 0 if results and all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
