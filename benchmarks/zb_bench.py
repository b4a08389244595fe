"""ZB-H1 vs 1F1B, measured on this machine: idle fraction, step time, T_F / T_B / T_W and the closed form.

PP=2 on 2 processes (torchrun, gloo) with one thread each (OMP_NUM_THREADS=1, so the two ranks do not share a
core), a model big enough that GEMMs dominate (hidden 1024, FFN 4096, 4 layers, sequence 128) with a
64-token vocabulary so the last stage's output layer and loss do not make it the slower stage (an unbalanced
pipeline idles its faster stage under every schedule, which hides the bubble), 8 microbatches per step. The same job is built twice in the same ranks — Megatron's 1F1B and our ZB-H1, same
weights and data, the rank wing's own Loop.train_step — and trained in alternating steps, so a busy shared
machine slows both alike; every step is recorded (the ``schedule.record_timeline`` recorder).

- step time: the median of the logged step times after the first (warm-up) step;
- idle fraction: per recorded step (all after the first), 1 - compute / (ranks x makespan of the
  forward-backward), communication and waiting counted as idle (launcher.core.pipeline.timeline.idle_fraction); median;
- T_F, T_B, T_W: median span lengths in the ZB-H1 timelines (slowest stage); 1F1B's T_B+T_W is its BW span;
- closed form (Qi et al. 2024): makespan m(T_F+T_B+T_W) + bubble, bubble (p-1)(T_F+T_B+T_W) for 1F1B and
  (p-1)(T_F+T_B-T_W) for ZB-H1; idle fraction = bubble / makespan.

    .venv/bin/python benchmarks/zb_bench.py            # ~2-3 minutes on 2 cores
    .venv/bin/python benchmarks/zb_bench.py --figure benchmarks/figures/zb_bench_executed.png
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

P, MICROBATCHES = 2, 8
JOB = ["data=mock", "schedule.kind=1f1b", "parallel.tensor=1", f"parallel.pipeline={P}", "cluster.gpus_per_node=2",
       "model.num_layers=4", "model.hidden_size=1024", "model.ffn_hidden_size=4096", "model.num_attention_heads=16",
       "model.num_query_groups=16", "model.seq_length=128", "model.vocab_size=64",
       "model.make_vocab_size_divisible_by=64", "train.micro_batch_size=1",
       f"train.global_batch_size={MICROBATCHES}", "train.eval_interval=0", "logging.tensorboard=false",
       "checkpoint.save_at_end=false"]


# --tiny: the same job at a toy shape, so tests/test_benchmarks.py runs the benchmark end to end in seconds (its
# figures mean nothing at that size; it checks the workers, the replay and the printout still work together)
TINY_SHAPE = {"model.hidden_size": "64", "model.ffn_hidden_size": "128", "model.num_attention_heads": "4",
              "model.num_query_groups": "4", "model.seq_length": "32"}


def overridden(overrides: list[str], values: dict) -> list[str]:
    """``overrides`` (key=value) with the keys in ``values`` set to theirs."""
    return [f"{key}={values[key]}" if key in values else a for a, key in ((a, a.split("=", 1)[0]) for a in overrides)]


def job(tiny: bool = False) -> list[str]:
    """JOB, at TINY_SHAPE with ``tiny``."""
    return overridden(JOB, TINY_SHAPE if tiny else {})


def run(steps: int, work: Path, tiny: bool = False) -> dict:
    """Both schedules in one torchrun, alternating steps (benchmarks/_zb_bench_worker.py)."""
    out = work / "record.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={P}", "--standalone",
           str(ROOT / "benchmarks" / "_zb_bench_worker.py"), str(out), str(steps), *job(tiny),
           f"train.train_steps={steps}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"benchmark failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    ranks = json.loads(out.read_text())
    res = {}
    for kind in (Schedule.ONE_F_ONE_B, Schedule.ZB_H1):
        per_step = [[[tuple(s) for s in r["record"][kind]["steps"][i]] for r in ranks] for i in range(steps)]
        cpu = [[r["record"][kind]["cpu"][i] for r in ranks] for i in range(steps)]
        res[kind] = {"ms": ranks[0]["record"][kind]["ms"], "loss": ranks[0]["record"][kind]["loss"],
                     "timelines": per_step[-1], "steps": per_step[1:], "cpu": cpu[1:]}
    return res


def replayed(steps, cpu, planned, placement: str, labels: bool = True) -> list:
    """Each recorded step replayed with a core per rank (``launcher.plan.simulator.replay``): every compute op's
    measured CPU seconds through the planned order (checked against the executed one) and its dependencies, p2p
    time not counted. On a machine with fewer cores than ranks this is the schedule's idle fraction the wall
    clock cannot show (a descheduled rank's op looks long, the others' waits hide behind it); with a core per
    rank it tracks the wall-clock figure less the p2p time."""
    from launcher.core.pipeline import timeline
    from launcher.plan import simulator

    out = []
    for spans, seconds in zip(steps, cpu):
        executed, durations = [], []
        for tl, sec in zip(spans, seconds):
            ops = sorted((s for s in zip(tl, sec) if s[0][0] in timeline.COMPUTE), key=lambda s: s[0][3])
            executed.append([s for s, _ in ops])
            durations.append([d for _, d in ops])
        out.append(simulator.replay(planned, executed, durations, placement, labels=labels))
    return out


def wall_to_cpu(steps, cpu) -> float:
    """Median over compute ops of wall / CPU seconds: 1.0 when every rank had a core to itself."""
    from launcher.core.pipeline import timeline

    return statistics.median((s[4] - s[3]) / d for spans, sec in zip(steps, cpu) for tl, c in zip(spans, sec)
                             for s, d in zip(tl, c) if s[0] in timeline.COMPUTE and d > 0)


def median_span(steps, kind: str) -> float:
    """Slowest stage's median duration of ``kind`` spans over the recorded steps (the median resists the
    preemptions of a shared machine)."""
    per_rank = [statistics.median(e - s for tl in (step[r] for step in steps) for k, _, _, s, e in tl if k == kind)
                for r in range(len(steps[0])) if any(k == kind for k, *_ in steps[0][r])]
    return max(per_rank)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--tiny", action="store_true", help="a toy shape (the test's smoke run; figures meaningless)")
    parser.add_argument("--figure", type=Path, help="also draw both executed timelines into this PNG")
    args = parser.parse_args(argv)
    from launcher.core.pipeline import timeline

    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else "?"
    with tempfile.TemporaryDirectory() as tmp:
        res = run(args.steps, Path(tmp), args.tiny)
    print(f"machine load average before {' '.join(load)}, after "
          f"{' '.join(Path('/proc/loadavg').read_text().split()[:3]) if load != '?' else '?'} "
          f"(cores: {os.cpu_count()}; a load above the core count slows and jitters every span)")
    for kind, r in res.items():  # medians over the steps after the first (warm-up)
        r["step_ms"] = statistics.median(r["ms"][1:])
        r["idle"] = statistics.median(timeline.idle_fraction(step) for step in r["steps"])
        r["makespan_ms"] = 1e3 * statistics.median(timeline.window(st)[1] - timeline.window(st)[0]
                                                   for st in r["steps"])
    zb = res[Schedule.ZB_H1]["steps"]
    t_f, t_b, t_w = median_span(zb, "F"), median_span(zb, "B"), median_span(zb, "W")
    t_bw = median_span(res[Schedule.ONE_F_ONE_B]["steps"], "BW")
    busy = MICROBATCHES * (t_f + t_b + t_w)
    pred = {Schedule.ONE_F_ONE_B: (P - 1) * (t_f + t_b + t_w), Schedule.ZB_H1: (P - 1) * max(t_f + t_b - t_w, 0.0)}
    shape = {k.split(".")[-1]: v for k, v in (a.split("=", 1) for a in job(args.tiny)) if k.startswith("model.")}
    print(f"PP={P}, {MICROBATCHES} microbatches, 1 thread per rank; hidden {shape['hidden_size']}, FFN "
          f"{shape['ffn_hidden_size']}, {shape['num_layers']} layers, seq {shape['seq_length']}, vocabulary "
          f"{shape['vocab_size']}; {args.steps} steps (medians over the steps after the first)")
    print(f"measured T_F {t_f * 1e3:.1f} ms, T_B {t_b * 1e3:.1f} ms, T_W {t_w * 1e3:.1f} ms "
          f"(1F1B's BW {t_bw * 1e3:.1f} ms; T_B+T_W {1e3 * (t_b + t_w):.1f} ms)")
    print(f"{'schedule':10} {'step ms':>9} {'fwd-bwd makespan ms':>21} {'idle fraction':>14} "
          f"{'closed-form idle':>17} {'closed-form makespan ms':>24}")
    for kind, r in res.items():
        print(f"{kind:10} {r['step_ms']:9.1f} {r['makespan_ms']:21.1f} {r['idle']:14.3f} "
              f"{pred[kind] / (busy + pred[kind]):17.3f} {1e3 * (busy + pred[kind]):24.1f}")
    a, b = res[Schedule.ONE_F_ONE_B], res[Schedule.ZB_H1]
    zb, fb = pred[Schedule.ZB_H1], pred[Schedule.ONE_F_ONE_B]
    print(f"zb_h1 / 1f1b: idle fraction {b['idle'] / a['idle']:.3f} (closed form "
          f"{(zb / (busy + zb)) / (fb / (busy + fb)):.3f}), "
          f"step time {b['step_ms'] / a['step_ms']:.3f} (closed form {(busy + zb) / (busy + fb):.3f})")
    paired = statistics.median(z / o for z, o in zip(b["ms"][1:], a["ms"][1:]))
    paired_idle = statistics.median(timeline.idle_fraction(z) / timeline.idle_fraction(o)
                                    for z, o in zip(b["steps"], a["steps"]))
    print(f"paired (alternating steps, median of per-pair ratios): step time {paired:.3f}, idle fraction "
          f"{paired_idle:.3f}")
    from launcher.core.pipeline.schedules import build_schedule

    for kind, r in res.items():
        r["replay"] = replayed(r["steps"], r["cpu"], build_schedule(kind, P, MICROBATCHES), kind)
    ra, rb = (statistics.median(x.bubble_fraction for x in r["replay"]) for r in (a, b))
    ma, mb = (1e3 * statistics.median(x.makespan for x in r["replay"]) for r in (a, b))
    print(f"replayed with a core per rank (each op's CPU seconds through the executed order, p2p not counted; "
          f"wall/CPU per op {wall_to_cpu(a['steps'] + b['steps'], a['cpu'] + b['cpu']):.2f}): idle fraction 1f1b "
          f"{ra:.3f}, zb_h1 {rb:.3f} (ratio {rb / ra:.3f}); fwd-bwd makespan 1f1b {ma:.1f} ms, zb_h1 {mb:.1f} ms "
          f"(ratio {mb / ma:.3f})")
    same = all(abs(x - y) <= 1e-6 * abs(x) for x, y in zip(a["loss"], b["loss"]))
    print(f"losses equal (rel 1e-6): {same}; 1f1b {a['loss'][-1]:.6f} zb_h1 {b['loss'][-1]:.6f} at step {args.steps}")
    if args.figure:
        timeline.draw(args.figure, [("1f1b (Megatron-Core) executed, PP=2, CPU", a["timelines"]),
                                    ("zb_h1 (ours) executed, PP=2, CPU", b["timelines"])], time_label="seconds")
        print(f"figure: {args.figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
