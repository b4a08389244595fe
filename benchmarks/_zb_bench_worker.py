"""torchrun worker of benchmarks/zb_bench.py: the same job built twice in the same ranks (Megatron's 1F1B and
our ZB-H1, same weights and data), trained in alternating steps so both see the same machine load, each step
recorded (launcher.rank.zb_executor.Recorder: spans and their CPU seconds) and timed.

Usage: torchrun --nproc_per_node=2 benchmarks/_zb_bench_worker.py OUT.json STEPS override [override ...]
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from launcher.schema import Schedule  # noqa: E402


def build(job, layout, kind: str, cache: str):
    from launcher.rank import training

    job = dataclasses.replace(job, schedule=dataclasses.replace(job.schedule, kind=kind, record_timeline=True))
    t = training.build(job, layout)  # production's own build sequence
    iters, _ = t.iterators(cache_dir=cache)
    return t.loop, iters


def main(kinds=(Schedule.ONE_F_ONE_B, Schedule.ZB_H1), build_run=None) -> int:
    """Build the job once per schedule in ``kinds`` (with ``build_run``, default ``build``) and train them in
    alternating steps; benchmarks/_zbv_bench_worker.py runs the same loop for interleaved vs ZB-V."""
    out, steps, overrides = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    build_run = build_run or build
    import torch
    from megatron.core import parallel_state as ps

    from launcher.config import compose_job
    from launcher.core import derive
    from launcher.rank import setup
    from launcher.rank.loop import reduce_report

    job = compose_job(overrides)
    layout = derive(job)
    setup.init_distributed(cluster=job.cluster, layout=layout, seed=job.train.seed)
    runs = {kind: build_run(job, layout, kind, str(out.parent / "cache")) for kind in kinds}
    record = {kind: {"ms": [], "loss": [], "steps": [], "cpu": []} for kind in runs}
    for _ in range(steps):
        for kind, (lp, iters) in runs.items():  # alternate: one step of each kind, in turn
            torch.distributed.barrier()
            start = time.perf_counter()
            res = lp.train_step(iters)
            loss, _ = reduce_report(res["local_loss"], None, kind)
            record[kind]["ms"].append((time.perf_counter() - start) * 1e3)
            record[kind]["loss"].append(loss)
            record[kind]["steps"].append(list(lp.recorder.spans))
            record[kind]["cpu"].append(lp.recorder.cpu_seconds)  # per span, for the one-core-per-rank replay
    mine = {"pp": ps.get_pipeline_model_parallel_rank(), "record": record}
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    if torch.distributed.get_rank() == 0:
        out.write_text(json.dumps(sorted(everyone, key=lambda r: r["pp"])))
    setup.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
