"""Zero bubble on the catalogue: for every recipe with PP > 1, its published schedule next to the zero-bubble
variants at the same layout (PP, TP, CP, EP, batch, recompute and overlaps as published), as the planner predicts
them (no GPU involved: predictions, not measurements). The README's table is this script's output.

Variants: ZB-H1 at the recipe's own virtual pipeline (over its chunks when VPP > 1) and ZB-V (virtual_pipeline=2,
its op order generated for the planner's own chunk costs, schedule.zb_v_costs). Settings a variant has to change are listed (moe_a2a_overlap is
Megatron's combined-1F1B schedule); userbuffer TP overlap stays on, without the sub-overlaps TE forbids or that
would hold W's operands (models/deferred_wgrad.py ZB_TP_OVERLAP), their loss priced; a variant that does not validate
for running is left out, with why.

Run: .venv/bin/python benchmarks/zb_recipes.py [--markdown]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launcher.config import RECIPES_DIR  # noqa: E402
from launcher.config import compose_job  # noqa: E402
from launcher.plan import PlanError, plan_job  # noqa: E402
from launcher.plan.timing import zb_v_costs_best  # noqa: E402
from launcher.schema import Schedule  # noqa: E402
from launcher.validate import validate  # noqa: E402


def variants(job) -> list[tuple[str, list[str]]]:
    """(name, overrides) of the zero-bubble variants of a recipe at its layout."""
    changed = []
    if job.parallel.moe_a2a_overlap:
        changed.append("parallel.moe_a2a_overlap=false")
    # ZB-H1 at the recipe's own virtual pipeline (over its chunks when VPP > 1: schedules._zb_h1_interleaved);
    # ZB-V at two chunks. The recipe's overlap_p2p_comm stays where there is a virtual pipeline (p2p.plan posts
    # each receive one op early under it) and goes where there is none (Megatron's rule).
    vpp = job.parallel.virtual_pipeline or 1
    p2p_off = ["schedule.overlap_p2p_comm=false"] if job.schedule.overlap_p2p_comm else []
    return [(Schedule.ZB_H1, ["schedule.kind=zb_h1", *(p2p_off if vpp == 1 else []), *changed]),
            (Schedule.ZB_V, ["schedule.kind=zb_v", "parallel.virtual_pipeline=2", *changed])]


def row(name: str, overrides: list[str]) -> dict:
    job = compose_job([f"recipe={name}", *overrides])
    if job.schedule.kind == Schedule.ZB_V:  # the order tuned to this job's chunk costs
        costs, _ = zb_v_costs_best(job)
        overrides = [*overrides, f"schedule.zb_v_costs=[{','.join(f'{c:g}' for c in costs)}]"]
        job = compose_job([f"recipe={name}", *overrides])
    errors = [p.line() for p in validate(job) if p.severity == "error"]
    try:
        plan = plan_job(job)
    except PlanError:  # an explicit per-chunk layout (pipeline_model_parallel_layout) fixes the VPP
        return {"kind": job.schedule.kind, "vpp": job.parallel.virtual_pipeline or 1, "overrides": overrides,
                "errors": errors}
    return {"kind": job.schedule.kind, "vpp": job.parallel.virtual_pipeline or 1, "tokens_per_s": plan.perf["tokens_per_s"],
            "bubble": plan.step.bubble_fraction, "peak_gb": plan.peak_gb, "fits": plan.peak_gb <= job.cluster.gpu_memory_gb,
            "overrides": overrides, "errors": errors}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    lines = []
    for name in sorted(p.stem for p in (RECIPES_DIR / "recipe").glob("*.yaml")):
        job = compose_job([f"recipe={name}"])
        if job.parallel.pipeline < 2:
            continue
        base = row(name, [])
        best = None
        for kind, overrides in variants(job):
            r = row(name, overrides)
            note = "; ".join(e.split(": ", 1)[1].split("; try")[0] for e in r["errors"][:1])
            if r["errors"]:
                r["why"] = note
            elif best is None or r["tokens_per_s"] > best["tokens_per_s"]:
                best = r
            lines.append((name, base, r))
        print(f"{name}: published {base['kind']} VPP{base['vpp']} {base['tokens_per_s']:,.0f} tok/s, "
              f"best ZB {best['kind'] if best else '-'} "
              f"{(best['tokens_per_s'] / base['tokens_per_s']) if best else float('nan'):.3f}x", file=sys.stderr)
    if args.markdown:
        print("| recipe | published | tokens/s | bubble | peak GB | zero bubble | tokens/s (x published) | bubble |"
              " peak GB | settings changed |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    for name, base, r in lines:
        changed = [o for o in r["overrides"] if not o.startswith(("schedule.kind=", "schedule.overlap_p2p_comm=",
                                                                   "schedule.zb_v_costs="))]
        if r.get("why"):
            cell = f"refused: {r['why']}"
            nums = "- | - | -"
        else:
            cell = ", ".join(changed) or "none"
            nums = (f"{r['tokens_per_s']:,.0f} ({r['tokens_per_s'] / base['tokens_per_s']:.3f}x) | "
                    f"{r['bubble']:.1%} | {r['peak_gb']:.1f}{'' if r['fits'] else ' (does not fit)'}")
        pub = f"{base['kind']} VPP{base['vpp']}"
        if args.markdown:
            print(f"| {name} | {pub} | {base['tokens_per_s']:,.0f} | {base['bubble']:.1%} | {base['peak_gb']:.1f} | "
                  f"{r['kind']} | {nums} | {cell} |")
        else:
            print(f"{name:22s} {pub:17s} {base['tokens_per_s']:>12,.0f} {r['kind']:6s} {nums}  [{cell}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
