"""The GPU lane in one command, on a GPU node in the project's image (its own Python: no CPU venv):

    python tests/gpu/lane.py                 # every GPU of the node (8 for all of it; 4 for the pipelines)
    python tests/gpu/lane.py --gpus 1        # what fits on one GPU: FP8 training, resume, MFU
    python tests/gpu/lane.py --out DIR --budget-s 900

Runs tests/gpu/test_first_node.py (each job rendered by the launcher and run by its launch.sh, as a user's) within
a wall-clock budget (15 minutes by default; what has not finished by then is reported as not run, and the lane
fails), and writes one report a user can send us: DIR/gpu-lane-report.json (machine, software, every check's
outcome and its measurements) and DIR/gpu-lane-report.txt (the same as a table, also printed).
Exit code: 0 when every check that could run on this node passed; 1 otherwise; 2 with a one-line reason when the
machine cannot run the lane at all (no CUDA, no megatron-core, no Transformer Engine).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUDGET_S = 900
"""The lane's wall-clock budget on one 8-GPU node (the issue that set it: one node, 15 minutes)."""
ONE_GPU = "fp8_small_llama or checkpoint_resumes or mfu"
"""The checks that fit on one GPU (NCCL refuses two ranks on one device)."""
REPORT = "gpu-lane-report"


def missing() -> str | None:
    """Why this machine cannot run the lane, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device visible (torch.cuda.is_available() is False)"
    for module, why in (("megatron", "megatron-core (pip install --no-deps megatron-core==0.19.2)"),
                        ("transformer_engine", "Transformer Engine (the project's GPU image has it: Dockerfile)")):
        if importlib.util.find_spec(module) is None:
            return f"{why} is not importable"
    return None


def machine() -> dict:
    """What the report says about the node and its software (nothing secret: no environment dump)."""
    info = {"host": platform.node(), "python": platform.python_version(), "when": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.version.cuda, gpus=torch.cuda.device_count(),
                    gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                    nccl=".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None)
    except Exception as exc:  # a report is still written when torch is broken: that is what it must say
        info["torch_error"] = repr(exc)
    for name in ("megatron.core", "transformer_engine"):
        try:
            from importlib.metadata import version

            info[name] = version({"megatron.core": "megatron-core", "transformer_engine": "transformer-engine"}[name])
        except Exception:
            info[name] = None
    return info


def outcomes(results: Path) -> list[dict]:
    """Every check's outcome as the lane's pytest plugin (tests/gpu/_lane_plugin.py) wrote it: test, outcome
    (passed/failed/skipped/error), seconds, message."""
    if not results.is_file():
        return []
    return [json.loads(line) for line in results.read_text().splitlines() if line.strip()]


def _kill_jobs_under(path: Path) -> None:
    """Every process whose command line names ``path`` (the jobs pytest started in sessions of their own, which
    killing pytest's process group does not reach)."""
    killed = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if str(path) in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                os.kill(int(proc.name), 9)
                killed.append(proc)
        except (OSError, ProcessLookupError):
            continue
    # SIGKILL is delivered asynchronously: wait (bounded) until each is gone or a zombie, so that the lane's
    # report is written only once no job of it still runs (a check right after the kill found one still alive)
    deadline = time.monotonic() + 30
    while killed and time.monotonic() < deadline:
        killed = [p for p in killed if _alive(p)]
        if killed:
            time.sleep(0.05)


def _alive(proc: Path) -> bool:
    """launcher/core/checkpoint/dirlock.py ``pid_alive``'s rule (a zombie is not alive), kept here because the lane
    runs in the GPU image's own Python without importing the launcher package (its core pulls in OmegaConf)."""
    try:
        fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X")


def build_report(cases: list[dict], measurements: list[dict], info: dict, *, budget_s: float, elapsed_s: float,
                 timed_out: bool, selection: str | None) -> dict:
    """The report: machine, budget, every check with its measurements; ``ok`` when every check that ran passed,
    at least one ran, and the budget held."""
    by_test: dict = {}
    for m in measurements:
        by_test.setdefault(m["test"], []).append({k: v for k, v in m.items() if k != "test"})
    ran = [c for c in cases if c["outcome"] != "skipped"]
    ok = bool(ran) and all(c["outcome"] == "passed" for c in ran) and not timed_out
    return {"ok": ok, "machine": info, "budget_s": budget_s, "elapsed_s": round(elapsed_s, 1), "timed_out": timed_out,
            "selection": selection, "checks": cases, "measurements": by_test}


def table(report: dict) -> str:
    """The report as text: one line per check, then the measurements."""
    info = report["machine"]
    lines = [f"GPU lane {'PASSED' if report['ok'] else 'FAILED'}: {info.get('gpus')} x {info.get('gpu')}, torch "
             f"{info.get('torch')}, CUDA {info.get('cuda')}, NCCL {info.get('nccl')}, TE {info.get('transformer_engine')}, "
             f"megatron-core {info.get('megatron.core')}, commit {info.get('commit')}",
             f"wall {report['elapsed_s']:.0f} s of a {report['budget_s']:.0f} s budget"
             + (" (budget exceeded: the checks not listed did not run)" if report["timed_out"] else ""), "",
             f"{'check':72} {'outcome':8} {'s':>6}  note"]
    for c in report["checks"]:
        lines.append(f"{c['test'][:72]:72} {c['outcome']:8} {c['seconds']:6.0f}  {c['message'][:100]}")
    if report["measurements"]:
        lines += ["", "measurements:"]
        for test, rows in sorted(report["measurements"].items()):
            for row in rows:
                lines.append(f"  {test}: {json.dumps(row, sort_keys=True)}")
    return "\n".join(lines) + "\n"


def write(out: Path, report: dict) -> None:
    """The json and the table, each written whole (a temporary file renamed over the old one)."""
    out.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(report, indent=2) + "\n"), (".txt", table(report))):
        tmp = out / f".{REPORT}{suffix}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / f"{REPORT}{suffix}")


def lane(out: Path, *, budget_s: float = BUDGET_S, select: str | None = None, gpus: int | None = None,
         tests: Path = ROOT / "tests" / "gpu" / "test_first_node.py") -> dict:
    """Run the checks in ``tests`` (pytest, the lane's plugin) within ``budget_s``, write and return the report."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("results.jsonl", "measurements.jsonl"):
        (out / stale).unlink(missing_ok=True)
    env = dict(os.environ, LAUNCHER_GPU_LANE_OUT=str(out),
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "gpu"), os.environ.get("PYTHONPATH", "")]))
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "_lane_plugin",
           f"--basetemp={out / 'runs'}", str(tests), *(["-k", select] if select else [])]
    started, timed_out = time.monotonic(), False
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, 9)  # pytest, then the jobs it started (each in a session of its own)
        proc.wait()
        _kill_jobs_under(out / "runs")
    measurements = []
    if (out / "measurements.jsonl").is_file():
        measurements = [json.loads(line) for line in (out / "measurements.jsonl").read_text().splitlines() if line]
    report = build_report(outcomes(out / "results.jsonl"), measurements, machine(), budget_s=budget_s,
                          elapsed_s=time.monotonic() - started, timed_out=timed_out, selection=select)
    write(out, report)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=None, help="use this many GPUs (1: the one-GPU checks only)")
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-lane", help="where the report goes")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="wall-clock budget (s)")
    parser.add_argument("-k", dest="select", default=None, help="pytest -k expression (a subset of the checks)")
    args = parser.parse_args(argv)
    reason = missing()
    if reason:
        print(f"gpu lane: cannot run here: {reason}", file=sys.stderr)
        return 2
    report = lane(args.out, budget_s=args.budget_s, select=args.select or (ONE_GPU if args.gpus == 1 else None),
                  gpus=args.gpus)
    print(table(report))
    print(f"report: {args.out.resolve() / (REPORT + '.json')} and {args.out.resolve() / (REPORT + '.txt')}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
