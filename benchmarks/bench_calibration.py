"""Does a calibrated cluster profile carry from one layout to others? Measured on this machine (cluster=local).

Calibrate on one layout of the embedded default (recipe=smoke, TP2 x PP2, 1F1B, 4 CPU ranks over gloo), then
measure other layouts of the same job (TP/PP/VPP/DP mixes and a zero-bubble schedule) and compare the planner's
step time with the profile's own constants (uncalibrated) and with the fitted one (calibrated) against them.

- every layout runs as ``python -m launcher recipe=smoke LAYOUT action=bench``: the real run path (render the
  bundle, its launch.sh, torchrun), 8 steps; its step time is the median after 3 warm-up steps
  (launcher/calibration.py ``measured_step_s``), read from the bundle's report/metrics.json;
- the layouts run alternately (round 1: every layout, round 2: every layout, ...) so a busy shared machine slows
  them alike; a layout's measured step is the median over its rounds;
- the calibration layout's median is fitted (``fit_gemm_efficiency``) and written as a calibrated profile; the
  calibrated column is ``action=plan`` of each layout with ``cluster.profile`` set to it (compose applies it).

    .venv/bin/python benchmarks/bench_calibration.py                  # 7 layouts x 3 rounds, ~10 min on 2 cores
    .venv/bin/python benchmarks/bench_calibration.py --rounds 1 --only 2   # a quick look

Prints its figures; not a test.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CALIBRATION = ("TP2 PP2 1f1b (calibration)", [])
LAYOUTS = [
    ("TP1 PP1 DP4", ["parallel.tensor=1", "parallel.pipeline=1"]),
    ("TP2 PP1 DP2", ["parallel.tensor=2", "parallel.pipeline=1"]),
    ("TP1 PP4 1f1b", ["parallel.tensor=1", "parallel.pipeline=4"]),
    ("TP1 PP2 DP2 1f1b", ["parallel.tensor=1", "parallel.pipeline=2"]),
    ("TP1 PP2 VPP2 DP2 interleaved", ["parallel.tensor=1", "parallel.pipeline=2", "parallel.virtual_pipeline=2",
                                      "schedule.kind=interleaved", "schedule.batch_p2p_comm=false"]),
    ("TP2 PP2 zb_h1", ["schedule.kind=zb_h1"]),
]
BASE = ["recipe=smoke", "cluster=local"]


def bench(overrides: list[str], out_dir: Path) -> tuple[float, Path]:
    """One measured run (action=bench) of a layout: its median step time after warm-up (seconds), its bundle."""
    from launcher.calibration import measured_step_s

    cmd = [sys.executable, "-m", "launcher", *BASE, *overrides, "action=bench", f"output_dir={out_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    bundle = re.search(r"^bundle: (\S+)$", proc.stdout, re.M)
    if proc.returncode != 0 or bundle is None:
        raise SystemExit(f"bench failed ({proc.returncode}): {' '.join(overrides)}\n{proc.stdout[-3000:]}")
    metrics = json.loads((Path(bundle[1]) / "report" / "metrics.json").read_text())
    return measured_step_s(metrics), Path(bundle[1])


def planned(overrides: list[str]) -> float:
    """The planner's step time for the layout (with whatever cluster.profile the overrides set)."""
    from launcher.calibration import planned_step_s
    from launcher.config import compose_job

    return planned_step_s(compose_job([*BASE, *overrides]))


def median_passes(bundles: list[Path]) -> dict | None:
    """The calibration rounds' per-stage pass times (launcher/calibration.py read_passes), median over rounds."""
    from launcher.calibration import read_passes

    rounds = [p for p in (read_passes(b) for b in bundles) if p]
    if not rounds:
        return None
    out = {st: {k: statistics.median(r[st][k] for r in rounds) for k in rounds[0][st]}
           for st in rounds[0] if st != "cpu"}
    if all(r.get("cpu") for r in rounds):
        out["cpu"] = True
    return out


def write_calibration(measured: float, passes: dict | None, out_dir: Path) -> tuple[Path, dict]:
    """Fit the calibration layout's median step and passes and write the profile, as action=bench does for one
    run."""
    from launcher.calibration import calibrated_profile, fit_profile, planned_step_s, write_profile
    from launcher.config import compose_job

    job = compose_job([*BASE, *CALIBRATION[1]])
    fitted, sources, bounded = fit_profile(job, measured, passes)
    record = {"job": job.name, "layout": CALIBRATION[0], "measured_step_s": round(measured, 6),
              "planned_step_s": round(planned_step_s(job), 6), "when": datetime.datetime.now(
                  datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "sources": sources,
              "statistic": "median over rounds of the median step after warm-up", "at_bound": bounded}
    path = write_profile(out_dir / "calibrated-local.yaml", calibrated_profile(job, fitted, record))
    return path, fitted


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (a layout's figure: their median)")
    ap.add_argument("--only", type=int, default=len(LAYOUTS), help="measure only the first N other layouts")
    ap.add_argument("--keep", default=None, help="copy the calibrated profile here")
    args = ap.parse_args(argv)
    layouts = [CALIBRATION, *LAYOUTS[:args.only]]
    load_before = os.getloadavg()[0]
    runs: dict[str, list[float]] = {name: [] for name, _ in layouts}
    bundles: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="bench-calibration-") as tmp:
        out = Path(tmp)
        for r in range(args.rounds):
            for name, overrides in layouts:
                step, bundle = bench(overrides, out / "runs")
                runs[name].append(step)
                if name == CALIBRATION[0]:
                    bundles.append(bundle)
                print(f"round {r + 1}: {name}: {runs[name][-1]:.3f} s/step (load {os.getloadavg()[0]:.1f})", flush=True)
        measured = {name: statistics.median(v) for name, v in runs.items()}
        profile, fitted = write_calibration(measured[CALIBRATION[0]], median_passes(bundles), out)
        print(f"\ncalibrated on {CALIBRATION[0]}: " + ", ".join(f"cluster.{k} {v:.4g}" for k, v in fitted.items()))
        print(f"{datetime.date.today()}; {args.rounds} alternating rounds; load average {load_before:.1f} before, "
              f"{os.getloadavg()[0]:.1f} after, on {os.cpu_count()} cores\n")
        head = f"{'layout':32s} {'measured s':>10s} {'runs':>22s} {'planned':>9s} {'err':>7s} {'calibrated':>10s} {'err':>7s}"
        print(head)
        print("-" * len(head))
        within = []
        for name, overrides in layouts:
            m = measured[name]
            unc, cal = planned(overrides), planned([*overrides, f"cluster.profile={profile}"])
            e_unc, e_cal = (unc - m) / m, (cal - m) / m
            if name != CALIBRATION[0]:
                within.append(abs(e_cal) <= 0.15)
            shown = ",".join(f"{x:.2f}" for x in runs[name])
            print(f"{name:32s} {m:10.3f} {shown:>22s} {unc:9.3f} {e_unc:+7.0%} {cal:10.3f} {e_cal:+7.0%}")
        print(f"\ncalibrated within 15%: {sum(within)} of {len(within)} other layouts")
        if args.keep:
            import shutil

            shutil.copy(profile, args.keep)
            print(f"profile kept: {args.keep}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
