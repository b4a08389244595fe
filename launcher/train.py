"""Rank entry: ``torchrun --nproc_per_node=N -m launcher.train --bundle DIR`` (DIR/config.yaml resolved).

parse -> build (dist, model, optimizer, data) -> resume -> run (log, eval, checkpoint) -> report -> close.
Contract with the job script: a ``DIR/STOP`` file makes every rank checkpoint and exit 0 at the next step;
``DIR/DONE`` is written once all steps have run.
Nothing runs at import time (dist_checkpointing spawns a helper process that re-imports this module).
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path


def main(argv=None) -> int:
    args = _parse(argv)
    from launcher.config import load_job

    bundle = Path(args.bundle)
    job = load_job(bundle / "config.yaml")
    from launcher.plan.flops import flops_per_token
    from launcher.rank import checkpoint as ckpt, data, loop, metrics, optim, setup
    from megatron.core import parallel_state as ps
    from models import build_model

    import torch

    setup.init_distributed(cluster=job.cluster, parallel=job.parallel, seed=job.train.seed)
    rank, world, dp = torch.distributed.get_rank(), torch.distributed.get_world_size(), ps.get_data_parallel_world_size()
    tr = job.train
    steps, num_microbatches = loop.run_length(job, dp_size=dp)
    chunks = build_model(model=job.model, parallel=job.parallel, precision=job.precision, schedule=job.schedule,
                         seed=tr.seed, recompute=tr.recompute, recompute_num_layers=tr.recompute_num_layers)
    model = optim.wrap_ddp(chunks, parallel=job.parallel)
    optimizer = optim.build_optimizer(model, train=tr, parallel=job.parallel, precision=job.precision)
    scheduler = optim.build_scheduler(optimizer, train=tr, steps=steps)
    optim.hook_model_config(model, optimizer, parallel=job.parallel)
    lp = loop.Loop(model=model, optimizer=optimizer, scheduler=scheduler, train=tr, seq_length=job.model.seq_length,
                   num_microbatches=num_microbatches, kind=job.schedule.kind, dp_size=dp)
    ckpt.check_options(job.checkpoint, rank)
    ckpt_dir = Path(job.checkpoint.dir) if job.checkpoint.dir else bundle / "checkpoints"
    latest = ckpt.latest_checkpoint(ckpt_dir) if job.checkpoint.resume else None
    saved_at = 0
    if latest is not None:
        lp.step, lp.consumed = ckpt.load(latest, model=model, optimizer=optimizer, scheduler=scheduler)
        saved_at = lp.step
        if rank == 0:
            print(f"resumed from {latest} at step {lp.step} ({lp.consumed} samples consumed)", flush=True)
    train_iters, valid_iters = data.build_train_valid_iterators(
        data=job.data, model=job.model, train=tr, steps=steps, consumed_samples=lp.consumed,
        dp_rank=ps.get_data_parallel_rank(), dp_size=dp, num_chunks=len(model),
        cache_dir=job.data.cache_dir or str(bundle / "data_cache"))
    log = metrics.MetricsLogger(logging=job.logging, bundle=bundle, run_name=job.name, config=asdict(job), rank=rank)

    def save():
        nonlocal saved_at
        saved_at = lp.step
        path = ckpt.save(ckpt_dir, model=model, optimizer=optimizer, scheduler=scheduler, step=lp.step,
                         consumed=lp.consumed, keep_last=job.checkpoint.keep_last)
        if rank == 0:
            print(f"saved checkpoint {path}", flush=True)

    minutes = tr.exit_after_minutes
    fpt = flops_per_token(job.model)
    why = lp.run(iterators=train_iters, valid_iters=valid_iters, steps=steps, on_step=log.step, on_eval=log.eval,
                 on_checkpoint=save, save_interval=job.checkpoint.save_interval, flops_per_token=fpt,
                 peak_tflops=job.cluster.peak_tflops_bf16, world=world,
                 deadline=time.time() + minutes * 60 if minutes else None, stop_file=bundle / "STOP")
    if (job.checkpoint.save_at_end or why == "stopped") and lp.step > saved_at:
        save()
    final = metrics.summary(log.history, log.evals, status=why, steps=lp.step, world=world, flops_per_token=fpt)
    log.close(final)
    if why == "done" and rank == 0:
        (bundle / "DONE").write_text(f"{lp.step}\n")  # the job script requeues only runs without DONE
    setup.close()
    return 0


def _parse(argv):
    parser = argparse.ArgumentParser(prog="launcher.train", description=__doc__)
    parser.add_argument("--bundle", required=True, help="run bundle directory containing config.yaml")
    return parser.parse_args(argv)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # a clean non-zero exit (torchrun reports the failing rank)
        traceback.print_exc()
        sys.exit(1)
