"""What `schedule.record_timeline=true` costs: the embedded default (smoke, TP2 x PP2 on 4 CPU processes) trained
with and without the recorder, runs interleaved (off, on, off, on, ...), step time = median over each run's
steps after the first, ratio of the medians over runs.

    .venv/bin/python benchmarks/timeline_overhead.py            # ~3 minutes on 2 cores
    .venv/bin/python benchmarks/timeline_overhead.py --schedule 1f1b --repeat 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(out: Path, schedule: str, record: bool, steps: int) -> list[float]:
    """Step times (ms) of one `python -m launcher` run, the first (warm-up) step dropped."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "launcher", f"schedule.kind={schedule}", f"train.train_steps={steps}",
           "train.eval_interval=0", "checkpoint.save_at_end=false", "logging.tensorboard=false",
           f"schedule.record_timeline={'true' if record else 'false'}", f"output_dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    (bundle,) = [p for p in out.iterdir() if (p / "report" / "metrics.json").is_file()]
    if record:
        assert (bundle / "timeline" / "spans.json").is_file(), "the recorder wrote no timeline"
    steps_ = json.loads((bundle / "report" / "metrics.json").read_text())["steps"]
    return [s["ms_per_step"] for s in steps_[1:]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="zb_h1", choices=["zb_h1", "1f1b"])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args(argv)
    load = Path("/proc/loadavg").read_text().split()[:3]
    medians: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            for record in (False, True):
                ms = run(Path(tmp) / f"{i}-{record}", args.schedule, record, args.steps)
                medians[record].append(statistics.median(ms))
    off, on = statistics.median(medians[False]), statistics.median(medians[True])
    print(f"smoke (TP2 x PP2, 4 CPU processes), schedule {args.schedule}, {args.steps} steps per run, {args.repeat} "
          f"interleaved runs each; load average before {' '.join(load)}, after "
          f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])} on {os.cpu_count()} cores")
    print(f"record_timeline=false  median step {off:8.1f} ms  (per run {', '.join(f'{m:.1f}' for m in medians[False])})")
    print(f"record_timeline=true   median step {on:8.1f} ms  (per run {', '.join(f'{m:.1f}' for m in medians[True])})")
    print(f"on / off: {on / off:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
