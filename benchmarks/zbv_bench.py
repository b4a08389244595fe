"""ZB-V vs Megatron's interleaved 1F1B, two chunks per rank, PP=4, measured on this machine: idle fraction and step
time, the same run, alternating steps, medians (as benchmarks/zb_bench.py does for ZB-H1 vs 1F1B).

PP=4 on 4 processes (torchrun, gloo), one thread each; 8 layers (one per chunk), hidden 1024, FFN
4096, sequence 128, two sequences per microbatch, a 64-token vocabulary so no stage is made slower by the output
layer (balanced shapes, as in the ZB-H1 benchmark), 8 microbatches. ZB-V's order is generated for the chunk costs
``--costs`` gives (schedule.zb_v_costs; default ``measured-stages``: a 3-step run's CPU seconds per op kind and
pipeline stage; ``measured``: one triple for every stage; or given numbers).
Both schedules are built in the same ranks, same weights and data, trained in alternating steps; every step
recorded.

Caveat: 4 ranks on a machine with fewer cores share them; a descheduled rank inside an op counts as busy and an idle
rank's core serves another, so the wall-clock idle fractions are not the pipeline's bubble. The benchmark also
prints the replay (benchmarks/zb_bench.py ``replayed``): each op's thread CPU seconds through the executed order and
its dependencies, what a core per rank would show less p2p time; "wall/CPU per op" says how much ranks waited for a
core (1.0: not at all).

    .venv/bin/python benchmarks/zbv_bench.py [--steps 8] [--microbatches 8]
        [--costs measured-stages (default) | measured | 1,1,1]
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
sys.path.insert(0, str(ROOT))
from launcher.schema import Schedule  # noqa: E402
from zb_bench import TINY_SHAPE, overridden, replayed, wall_to_cpu  # noqa: E402  (the same replay as ZB-H1's)

P, MICROBATCHES = 4, 8
# two sequences per microbatch: a plain-torch stand-in for one such layer (F, an input-only B, the four weight GEMMs
# as W; one thread) timed 27/35/29 ms at 128 tokens and 49/53/52 ms at 256 on this CPU: at 256 tokens F, B and W are
# closer to the paper's T_F = T_B = T_W, where ZB-V's bubble is smallest
MBS = 2
JOB = ["data=mock", "schedule.kind=zb_v", "parallel.tensor=1", f"parallel.pipeline={P}",
       "parallel.virtual_pipeline=2", f"cluster.gpus_per_node={P}", "model.num_layers=8", "model.hidden_size=1024",
       "model.ffn_hidden_size=4096", "model.num_attention_heads=16", "model.num_query_groups=16",
       "model.seq_length=128", "model.vocab_size=64", "model.make_vocab_size_divisible_by=64",
       f"train.micro_batch_size={MBS}", f"train.global_batch_size={MBS * MICROBATCHES}", "train.eval_interval=0",
       "logging.tensorboard=false", "checkpoint.save_at_end=false"]


def job(tiny: bool = False, microbatches: int = MICROBATCHES) -> list[str]:
    """JOB, at zb_bench's TINY_SHAPE with ``tiny`` (the test's smoke run), with ``microbatches`` per step."""
    return overridden(JOB, {**(TINY_SHAPE if tiny else {}), "train.global_batch_size": str(MBS * microbatches)})


def run(steps: int, work: Path, costs: str, tiny: bool = False, microbatches: int = MICROBATCHES) -> dict:
    out = work / "record.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={P}", "--standalone",
           str(ROOT / "benchmarks" / "_zbv_bench_worker.py"), str(out), str(steps), *job(tiny, microbatches),
           f"train.train_steps={steps}", f"schedule.zb_v_costs=[{costs}]"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"benchmark failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    ranks = json.loads(out.read_text())
    res = {}
    for kind in (Schedule.INTERLEAVED, Schedule.ZB_V):
        per_step = [[[tuple(s) for s in r["record"][kind]["steps"][i]] for r in ranks] for i in range(steps)]
        cpu = [[r["record"][kind]["cpu"][i] for r in ranks] for i in range(steps)]
        res[kind] = {"ms": ranks[0]["record"][kind]["ms"], "loss": ranks[0]["record"][kind]["loss"],
                     "steps": per_step[1:], "cpu": cpu[1:]}
    return res


def median_span(steps, kind: str) -> float:
    return statistics.median(e - s for step in steps for tl in step for k, _, _, s, e in tl if k == kind)


def median_cpu(steps, cpu, kind: str) -> float:
    """Median thread CPU seconds of the ``kind`` ops (what the replay runs; wall spans include core sharing)."""
    return statistics.median(d for spans, sec in zip(steps, cpu) for tl, c in zip(spans, sec)
                             for sp, d in zip(tl, c) if sp[0] == kind)


def median_step(steps, cpu):
    """One step in which every op costs its median thread CPU seconds over the recorded steps (each rank runs the
    same ops in the same order every step): the schedule's idle at steady op costs, without the step-to-step
    jitter of ranks sharing two cores (the per-step replay keeps it)."""
    return [steps[0]], [[[statistics.median(step[r][i] for step in cpu) for i in range(len(cpu[0][r]))]
                         for r in range(len(cpu[0]))]]


def cpu_costs(res) -> str:
    """ZB-V's measured chunk costs T_F,T_B,T_W relative to the largest, as schedule.zb_v_costs takes them."""
    zb = res[Schedule.ZB_V]
    t = [median_cpu(zb["steps"], zb["cpu"], k) for k in "FBW"]
    return ",".join(f"{x / max(t):.2f}" for x in t)


def stage_costs(res) -> str:
    """ZB-V's measured costs per pipeline stage (rank r's chunk c is stage_of(zb_v, P, r, c)): one T_F,T_B,T_W per
    stage 0..2P-1, relative to the largest, as schedule.zb_v_costs takes them (6 x P numbers)."""
    from launcher.core.pipeline.schedules import stage_of

    cost = stage_cpu(res)
    per = [None] * (2 * P)
    for r in range(P):
        for c in (0, 1):
            per[stage_of(Schedule.ZB_V, P, r, c)] = [cost[(r, c, k)] for k in "FBW"]
    top = max(x for t in per for x in t)
    return ",".join(f"{x / top:.3f}" for t in per for x in t)


def stage_cpu(res) -> dict:
    """ZB-V's median thread CPU seconds per (rank, chunk, op kind): where the V puts extra work (rank 0 holds the
    embedding and the output layer + loss)."""
    zb = res[Schedule.ZB_V]
    out: dict = {}
    for spans, sec in zip(zb["steps"], zb["cpu"]):
        for r, (tl, c) in enumerate(zip(spans, sec)):
            for sp, d in zip(tl, c):
                out.setdefault((r, sp[2], sp[0]), []).append(d)
    return {key: statistics.median(v) for key, v in out.items()}


def print_stage_cpu(res) -> None:
    cost = stage_cpu(res)
    ranks = sorted({r for r, _, _ in cost})
    print("zb_v median CPU ms per op, by rank and chunk (F/B/W):")
    for r in ranks:
        cells = [f"chunk {c}: " + "/".join(f"{1e3 * cost.get((r, c, k), float('nan')):.1f}" for k in "FBW")
                 for c in (0, 1)]
        total = sum(v for (rr, _, k), v in cost.items() if rr == r and k in "FBW")
        print(f"  rank {r}: {'  '.join(cells)}  (sum {1e3 * total:.1f})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tiny", action="store_true", help="a toy shape (the test's smoke run; figures meaningless)")
    parser.add_argument("--microbatches", type=int, default=MICROBATCHES, help="per step, a multiple of PP (default "
                        "8; ZB-V's idle floor, rank r's r forwards at the start, is 0.37x interleaved's at 8, 0.35x "
                        "at 16, at equal op costs: more microbatches leave more margin where op costs hold still)")
    parser.add_argument("--costs", default="measured-stages", help="schedule.zb_v_costs: relative chunk T_F,T_B,T_W (or one "
                        "triple per stage, 6 x PP numbers), 'measured': a 3-step run first, its median CPU seconds per "
                        "op kind (what a user profiles before setting schedule.zb_v_costs), or 'measured-stages': "
                        "the same per pipeline stage (the default: the order a user would run, tuned to what they "
                        "profiled on their machine)")
    args = parser.parse_args(argv)
    from launcher.core.pipeline import timeline

    load = Path("/proc/loadavg").read_text().split()[:3]
    if args.costs in ("measured", "measured-stages"):
        with tempfile.TemporaryDirectory() as tmp:
            calibration = run(3, Path(tmp), "1,1,1", args.tiny, args.microbatches)
        print_stage_cpu(calibration)
        args.costs = (stage_costs if args.costs == "measured-stages" else cpu_costs)(calibration)
        print(f"calibration run (3 steps, zb_v at equal costs): chunk CPU seconds T_F,T_B,T_W = [{args.costs}]")
    with tempfile.TemporaryDirectory() as tmp:
        res = run(args.steps, Path(tmp), args.costs, args.tiny, args.microbatches)
    print(f"machine load average before {' '.join(load)}, after {' '.join(Path('/proc/loadavg').read_text().split()[:3])}"
          f" (cores: {os.cpu_count()}, ranks: {P})")
    zb = res[Schedule.ZB_V]["steps"]
    t_f, t_b, t_w = median_span(zb, "F"), median_span(zb, "B"), median_span(zb, "W")
    print(f"PP={P}, 2 chunks per rank, {args.microbatches} microbatches of {MBS} sequences, {args.steps} steps (medians "
          f"over the steps after the first); zb_v order for chunk costs [{args.costs}]; measured chunk T_F {t_f * 1e3:.1f} ms, T_B "
          f"{t_b * 1e3:.1f} ms, T_W {t_w * 1e3:.1f} ms wall (ratio {t_f / max(t_f, t_b, t_w):.2f},"
          f"{t_b / max(t_f, t_b, t_w):.2f},{t_w / max(t_f, t_b, t_w):.2f}); CPU seconds ratio "
          f"[{cpu_costs(res)}]")
    print_stage_cpu(res)
    print(f"{'schedule':12} {'step ms':>9} {'idle fraction':>14}")
    for kind, r in res.items():
        r["step_ms"] = statistics.median(r["ms"][1:])
        r["idle"] = statistics.median(timeline.idle_fraction(step) for step in r["steps"])
        print(f"{kind:12} {r['step_ms']:9.1f} {r['idle']:14.3f}")
    a, b = res[Schedule.INTERLEAVED], res[Schedule.ZB_V]
    paired = statistics.median(z / o for z, o in zip(b["ms"][1:], a["ms"][1:]))
    paired_idle = statistics.median(timeline.idle_fraction(z) / timeline.idle_fraction(o)
                                    for z, o in zip(b["steps"], a["steps"]))
    print(f"zb_v / interleaved: idle fraction {b['idle'] / a['idle']:.3f}, step time {b['step_ms'] / a['step_ms']:.3f}; "
          f"paired (median of per-pair ratios): idle {paired_idle:.3f}, step time {paired:.3f}")

    from launcher.core.pipeline.schedules import build_schedule

    costs = tuple(float(c) for c in args.costs.split(","))
    for kind, r in res.items():  # Megatron's interleaved spans are recorded from outside: kinds only, not labels
        r["replay"] = replayed(r["steps"], r["cpu"], build_schedule(kind, P, args.microbatches, 2, P, costs), kind,
                               labels=kind == Schedule.ZB_V)
        r["replay_idle"] = statistics.median(x.bubble_fraction for x in r["replay"])
        r["replay_ms"] = 1e3 * statistics.median(x.makespan for x in r["replay"])
    ratio = wall_to_cpu(a["steps"] + b["steps"], a["cpu"] + b["cpu"])
    print(f"replayed with a core per rank (each op's CPU seconds through the executed order, p2p not counted; "
          f"wall/CPU per op {ratio:.2f}, 1.0 when no rank waited for a core):")
    print(f"{'schedule':12} {'fwd-bwd ms':>11} {'idle fraction':>14}")
    for kind, r in res.items():
        print(f"{kind:12} {r['replay_ms']:11.1f} {r['replay_idle']:14.3f}")
    paired = statistics.median(z.bubble_fraction / o.bubble_fraction for z, o in zip(b["replay"], a["replay"]))
    print(f"zb_v / interleaved, replayed: idle fraction {b['replay_idle'] / a['replay_idle']:.3f}, fwd-bwd time "
          f"{b['replay_ms'] / a['replay_ms']:.3f}; paired idle {paired:.3f}")
    for kind, r in res.items():
        r["steady"] = replayed(*median_step(r["steps"], r["cpu"]), build_schedule(kind, P, args.microbatches, 2, P, costs),
                               kind, labels=kind == Schedule.ZB_V)[0]
    print("replayed once at each op's median CPU seconds over the steps (steady op costs, no step-to-step jitter):")
    for kind, r in res.items():
        print(f"{kind:12} {1e3 * r['steady'].makespan:11.1f} {r['steady'].bubble_fraction:14.3f}")
    print(f"zb_v / interleaved, at median op costs: idle fraction "
          f"{b['steady'].bubble_fraction / a['steady'].bubble_fraction:.3f}, fwd-bwd time "
          f"{b['steady'].makespan / a['steady'].makespan:.3f}")
    same = all(abs(x - y) <= 1e-6 * abs(x) for x, y in zip(a["loss"], b["loss"]))
    print(f"losses equal (rel 1e-6): {same}; interleaved {a['loss'][-1]:.6f} zb_v {b['loss'][-1]:.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
