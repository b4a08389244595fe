"""ZB-H1 vs 1F1B, measured on this machine: idle fraction, step time, T_F / T_B / T_W and the closed form.

Runs the real rank wing (``python -m launcher.rank`` under torchrun, gloo) twice on the same job, PP=2 on 2
processes with one thread each (OMP_NUM_THREADS=1, so the two ranks do not share a core), a model big enough
that GEMMs dominate (hidden 512, FFN 2048, 4 layers, sequence 256, vocabulary 1024), 8 microbatches per step:
once with Megatron's 1F1B, once with our ZB-H1, each with ``schedule.record_timeline=true``.

- step time: the median of the logged step times after the first (warm-up) step;
- idle fraction: per recorded step (all after the first), 1 - compute / (ranks x makespan of the
  forward-backward), communication and waiting counted as idle (launcher.core.timeline.idle_fraction); median;
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

P, MICROBATCHES = 2, 8
JOB = ["data=mock", "parallel.tensor=1", f"parallel.pipeline={P}", "cluster.gpus_per_node=2",
       "model.num_layers=4", "model.hidden_size=512", "model.ffn_hidden_size=2048", "model.num_attention_heads=8",
       "model.num_query_groups=8", "model.seq_length=256", "model.vocab_size=1024",
       "model.make_vocab_size_divisible_by=64", "train.micro_batch_size=1",
       f"train.global_batch_size={MICROBATCHES}", "train.eval_interval=0", "logging.tensorboard=false",
       "checkpoint.save_at_end=false", "schedule.record_timeline=true"]


def run(kind: str, steps: int, work: Path) -> dict:
    from launcher.config import compose_job, job_to_yaml

    bundle = work / kind
    bundle.mkdir(parents=True, exist_ok=True)
    (bundle / "config.yaml").write_text(job_to_yaml(compose_job(JOB + [f"schedule.kind={kind}",
                                                                       f"train.train_steps={steps}"])))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={P}", "--standalone",
           "-m", "launcher.rank", "--bundle", str(bundle)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise SystemExit(f"{kind} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    report = json.loads((bundle / "report" / "metrics.json").read_text())
    spans = json.loads((bundle / "timeline" / "spans.json").read_text())
    pipe = sorted(spans["ranks"], key=lambda r: r["pp"])
    steps = [[[tuple(s) for s in r["steps"][i]] for r in pipe] for i in range(1, len(pipe[0]["steps"]))]
    return {"ms": [h["ms_per_step"] for h in report["steps"]], "loss": [h["loss"] for h in report["steps"]],
            "timelines": [[tuple(s) for s in r["spans"]] for r in pipe], "steps": steps}


def median_span(steps, kind: str) -> float:
    """Slowest stage's median duration of ``kind`` spans over the recorded steps (the median resists the
    preemptions of a shared machine)."""
    per_rank = [statistics.median(e - s for tl in (step[r] for step in steps) for k, _, _, s, e in tl if k == kind)
                for r in range(len(steps[0])) if any(k == kind for k, *_ in steps[0][r])]
    return max(per_rank)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--figure", type=Path, help="also draw both executed timelines into this PNG")
    args = parser.parse_args(argv)
    from launcher.core import timeline

    with tempfile.TemporaryDirectory() as tmp:
        res = {kind: run(kind, args.steps, Path(tmp)) for kind in ("1f1b", "zb_h1")}
    for kind, r in res.items():  # medians over the steps after the first (warm-up)
        r["step_ms"] = statistics.median(r["ms"][1:])
        r["idle"] = statistics.median(timeline.idle_fraction(step) for step in r["steps"])
        r["makespan_ms"] = 1e3 * statistics.median(timeline.window(st)[1] - timeline.window(st)[0]
                                                   for st in r["steps"])
    zb = res["zb_h1"]["steps"]
    t_f, t_b, t_w = median_span(zb, "F"), median_span(zb, "B"), median_span(zb, "W")
    t_bw = median_span(res["1f1b"]["steps"], "BW")
    busy = MICROBATCHES * (t_f + t_b + t_w)
    pred = {"1f1b": (P - 1) * (t_f + t_b + t_w), "zb_h1": (P - 1) * max(t_f + t_b - t_w, 0.0)}
    print(f"PP={P}, {MICROBATCHES} microbatches, 1 thread per rank; hidden 512, FFN 2048, 4 layers, seq 256; "
          f"{args.steps} steps (medians over the steps after the first)")
    print(f"measured T_F {t_f * 1e3:.1f} ms, T_B {t_b * 1e3:.1f} ms, T_W {t_w * 1e3:.1f} ms "
          f"(1F1B's BW {t_bw * 1e3:.1f} ms; T_B+T_W {1e3 * (t_b + t_w):.1f} ms)")
    print(f"{'schedule':10} {'step ms':>9} {'fwd-bwd makespan ms':>21} {'idle fraction':>14} "
          f"{'closed-form idle':>17} {'closed-form makespan ms':>24}")
    for kind, r in res.items():
        print(f"{kind:10} {r['step_ms']:9.1f} {r['makespan_ms']:21.1f} {r['idle']:14.3f} "
              f"{pred[kind] / (busy + pred[kind]):17.3f} {1e3 * (busy + pred[kind]):24.1f}")
    a, b = res["1f1b"], res["zb_h1"]
    print(f"zb_h1 / 1f1b: idle fraction {b['idle'] / a['idle']:.3f} (closed form "
          f"{(pred['zb_h1'] / (busy + pred['zb_h1'])) / (pred['1f1b'] / (busy + pred['1f1b'])):.3f}), "
          f"step time {b['step_ms'] / a['step_ms']:.3f} (closed form {(busy + pred['zb_h1']) / (busy + pred['1f1b']):.3f})")
    same = all(abs(x - y) <= 1e-6 * abs(x) for x, y in zip(a["loss"], b["loss"]))
    print(f"losses equal (rel 1e-6): {same}; 1f1b {a['loss'][-1]:.6f} zb_h1 {b['loss'][-1]:.6f} at step {args.steps}")
    if args.figure:
        timeline.draw(args.figure, [("1f1b (Megatron-Core) executed, PP=2, CPU", a["timelines"]),
                                    ("zb_h1 (ours) executed, PP=2, CPU", b["timelines"])], time_label="seconds")
        print(f"figure: {args.figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
