"""How fast plan_job and search are, as ratios against a reference measured in the same run: the speed guards
that used to sit inside tests/test_plan_api.py and tests/test_plan_v2.py (CPU-second bounds that failed on busy
2-core machines, issue 25). A ratio moves with the code, not with how loaded the machine is: both sides are CPU
time of this thread, measured interleaved.

Run: .venv/bin/python benchmarks/planner_speed.py [--repeat 3]
Prints one line per case (median CPU s, reference CPU s, ratio, budget) and exits 1 if a ratio exceeds its budget.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from launcher.config import compose_job  # noqa: E402
from launcher.plan import plan_job  # noqa: E402
from launcher.plan.search import search  # noqa: E402


def reference() -> None:
    """The yardstick: compose, validate and plan the smoke recipe (the same kind of pure-Python work). Hydra's
    defaults-list merge included, as when the budgets were set: launcher.config keeps composed bases (stop 52), and
    a cached reference (~14 ms instead of ~0.2 s) turned every search's ratio over budget (166x, 105x)."""
    import launcher.config

    launcher.config._BASES.clear()
    plan_job(compose_job(["recipe=smoke"]))


def _cases():
    """(name, work, budget): each budget is about twice the ratio measured on 2026-12-01 (load average ~19 on 2
    cores; the ratios were 0.04x, 17.5x, 7.7x, 0.7x), i.e. it flags a planner or search that got twice slower."""
    import planner_accuracy as pa

    q30_job = compose_job(pa._overrides(pa.ROWS[6]))  # Qwen3-30B-A3B on 16 H100s (Megatron-Bridge 25.09)
    llama405 = compose_job(["recipe=llama405b", "cluster=h100"])
    yield "plan llama405b h100", lambda: plan_job(llama405), 1
    yield "search llama405b h100 top=5", lambda: search(llama405, top=5), 35
    yield "search qwen3_30b 16xH100 top=20", lambda: search(q30_job, top=20), 16
    moe = compose_job(["recipe=llama405b", "model=deepseek_v3", "cluster=h200", "nodes=8",
                       "parallel.first_stage_layers=null", "parallel.last_stage_layers=null", "parallel.pipeline=1",
                       "parallel.context=1", "parallel.expert=8", "parallel.tensor=1",
                       "parallel.sequence_parallel=false", "parallel.tp_comm_overlap=false"])
    yield "search deepseek_v3 64xH200 top=3", lambda: search(moe, top=3), 4


def cpu_s(fn) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    reference()  # first-call imports are nobody's cost
    failed = 0
    print(f"{'case':<36} {'median CPU s':>12} {'reference':>10} {'ratio':>8} {'budget':>7}")
    for name, fn, budget in _cases():
        fn()
        ours, refs = [], []
        for _ in range(args.repeat):  # interleaved, so both see the same load
            refs.append(cpu_s(reference))
            ours.append(cpu_s(fn))
        ratio = statistics.median(ours) / max(statistics.median(refs), 1e-9)
        failed += ratio > budget
        print(f"{name:<36} {statistics.median(ours):>12.3f} {statistics.median(refs):>10.4f} {ratio:>7.1f}x "
              f"{budget:>6}x{'  OVER BUDGET' if ratio > budget else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
