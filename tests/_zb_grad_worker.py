"""torchrun worker for tests/test_zero_bubble.py: one training step's loss and every parameter gradient under
Megatron's 1F1B and under our ZB-H1, on the same model weights and data, in the same processes.

Usage: torchrun --nproc_per_node=N tests/_zb_grad_worker.py OUT_DIR [--steps=K] override [override ...]
Writes OUT_DIR/rank-<r>.json: per-microbatch losses of both schedules (of the last of K steps, default 1), per
parameter the max |difference| and the max |gradient|, and the grad norm after clipping (optimizer step) of both.

``parallel.overlap_grad_reduce=true`` is honoured on CPU here (the launcher turns it off without CUDA): Megatron
DDP's asynchronous bucket reduces run on gloo as well, with buckets of BUCKET elements so a tiny model has several;
the report then lists, per bucket reduce started during the schedule of the last step, how many W GEMMs of
that step had run ("reduce_started_after_w").
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


BUCKET = 20_000
"""DDP bucket size (elements) under overlap_grad_reduce: several buckets for the tiny test model."""
EVENTS: list = []
"""("w", microbatch) per W GEMM and ("reduce",) per bucket reduce started, in order (overlap runs)."""


def _overlap_on_cpu(parallel) -> None:
    """Megatron DDP with the job's overlap_grad_reduce on CPU, small buckets, reduce starts recorded."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    from launcher.rank import optim
    from models import deferred_wgrad as zb

    shipped = optim.ddp_config

    def ddp_config(**kwargs):
        config = shipped(**kwargs)
        config.overlap_grad_reduce, config.bucket_size = True, BUCKET
        return config

    optim.ddp_config = ddp_config
    start = pgb._ParamAndGradBucketGroup.start_grad_sync

    def recorded_start(self, *args, **kwargs):
        EVENTS.append(("reduce",))
        return start(self, *args, **kwargs)

    pgb._ParamAndGradBucketGroup.start_grad_sync = recorded_start
    compute = zb._Wgrad.compute

    def recorded_compute(self):
        EVENTS.append(("w",))
        return compute(self)

    zb._Wgrad.compute = recorded_compute


def one_step(job, layout, kind: str, bundle: Path, steps: int = 1):
    """Fresh model (same seed), DDP, optimizer; ``steps`` forward-backwards of ``kind``; the last one's losses,
    grads and norm, the parameters after it."""
    import dataclasses

    import torch

    from launcher.rank import loop, training

    job = dataclasses.replace(job, schedule=dataclasses.replace(job.schedule, kind=kind))
    tr = job.train
    t = training.build(job, layout, loop=False)  # production's own build sequence; the steps driven here
    model, optimizer = t.model, t.optimizer
    iters, _ = t.iterators(cache_dir=str(bundle / "cache"))
    forward = loop.forward_step_for(micro_batch_size=job.train.micro_batch_size, seq_length=job.model.seq_length)
    for _ in range(steps):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        EVENTS.clear()
        losses = loop.schedule_func(kind)(forward_step_func=forward, data_iterator=iters[0], model=model,
                                          num_microbatches=layout.microbatches, seq_length=job.model.seq_length,
                                          micro_batch_size=job.train.micro_batch_size, forward_only=False)
        schedule_events = list(EVENTS)  # finalize_model_grads (inside the schedule call) starts none after step 1
        grads = {name: p.main_grad.detach().clone() for name, p in model[0].named_parameters()}
        _, grad_norm, _ = optimizer.step()
    params = {name: p.detach().clone() for name, p in model[0].named_parameters()}
    w_total = sum(e[0] == "w" for e in schedule_events)
    started = [sum(e[0] == "w" for e in schedule_events[:i]) for i, e in enumerate(schedule_events)
               if e[0] == "reduce"]
    from models.deferred_wgrad import ZB_ATTR

    deferred = [m for m in model[0].modules() if getattr(type(m), ZB_ATTR, False)]
    return ([float(x["lm loss"]) for x in losses], grads, float(grad_norm), params,
            {"reduce_started_after_w": started, "w_total": w_total, "deferred_linears": len(deferred),
             "deferred_expert_linears": sum(bool(getattr(m, "is_expert", False)) for m in deferred),
             "recompute_granularity": model[0].config.recompute_granularity})


def main() -> int:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    steps = 1
    if overrides and overrides[0].startswith("--steps="):
        steps, overrides = int(overrides[0].split("=", 1)[1]), overrides[1:]
    import torch

    from launcher.config import compose_job
    from launcher.core import derive
    from launcher.rank import setup

    job = compose_job(overrides)
    layout = derive(job)
    setup.init_distributed(cluster=job.cluster, layout=layout, seed=job.train.seed)
    rank = torch.distributed.get_rank()
    if job.parallel.overlap_grad_reduce:
        _overlap_on_cpu(job.parallel)
    ref_losses, ref_grads, ref_norm, ref_params, _ = one_step(job, layout, "1f1b", out, steps)
    zb_losses, zb_grads, zb_norm, zb_params, overlap = one_step(job, layout, "zb_h1", out, steps)
    assert ref_grads.keys() == zb_grads.keys()
    report = {
        "losses_1f1b": ref_losses, "losses_zb_h1": zb_losses, "grad_norm_1f1b": ref_norm, "grad_norm_zb_h1": zb_norm,
        "grads": {name: {"max_abs_diff": float((zb_grads[name] - g).abs().max()), "max_abs": float(g.abs().max())}
                  for name, g in ref_grads.items()},
        "params_max_abs_diff": max(float((zb_params[n] - p).abs().max()) for n, p in ref_params.items()),
        **overlap,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{rank}.json").write_text(json.dumps(report, indent=1))
    setup.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
