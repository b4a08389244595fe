"""torchrun worker for tests/test_zero_bubble.py: one training step's loss and every parameter gradient under
Megatron's 1F1B and under our ZB-H1, on the same model weights and data, in the same processes.

Usage: torchrun --nproc_per_node=N tests/_zb_grad_worker.py OUT_DIR override [override ...]
Writes OUT_DIR/rank-<r>.json: per-microbatch losses of both schedules, per parameter the max |difference| and
the max |gradient|, and the grad norm after clipping (optimizer step) of both.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def one_step(job, layout, kind: str, bundle: Path):
    """Fresh model (same seed), DDP, optimizer; one forward-backward of ``kind``; its losses, grads, norm."""
    import dataclasses

    import torch
    from megatron.core import parallel_state as ps

    from launcher.rank import data, loop, optim
    from models import build_model

    schedule = dataclasses.replace(job.schedule, kind=kind)
    chunks = build_model(model=job.model, parallel=job.parallel, precision=job.precision, layout=layout,
                         schedule=schedule, seed=job.train.seed)
    model = optim.wrap_ddp(chunks, parallel=job.parallel, precision=job.precision)
    optimizer = optim.build_optimizer(model, train=job.train, parallel=job.parallel, precision=job.precision)
    optim.hook_model_config(model, optimizer, parallel=job.parallel)
    iters, _ = data.build_train_valid_iterators(
        data=job.data, model=job.model, train=job.train, steps=layout.steps, consumed_samples=0,
        dp_rank=ps.get_data_parallel_rank(), dp_size=layout.dp, num_chunks=1, cache_dir=str(bundle / "cache"))
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = loop.schedule_func(kind)(forward_step_func=loop.forward_step, data_iterator=iters[0], model=model,
                                      num_microbatches=layout.microbatches, seq_length=job.model.seq_length,
                                      micro_batch_size=job.train.micro_batch_size, forward_only=False)
    grads = {name: p.main_grad.detach().clone() for name, p in model[0].named_parameters()}
    _, grad_norm, _ = optimizer.step()
    params = {name: p.detach().clone() for name, p in model[0].named_parameters()}
    return [float(x["lm loss"]) for x in losses], grads, float(grad_norm), params


def main() -> int:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    import torch

    from launcher.config import compose_job
    from launcher.core import derive
    from launcher.rank import setup

    job = compose_job(overrides)
    layout = derive(job)
    setup.init_distributed(cluster=job.cluster, layout=layout, seed=job.train.seed)
    rank = torch.distributed.get_rank()
    ref_losses, ref_grads, ref_norm, ref_params = one_step(job, layout, "1f1b", out)
    zb_losses, zb_grads, zb_norm, zb_params = one_step(job, layout, "zb_h1", out)
    assert ref_grads.keys() == zb_grads.keys()
    report = {
        "losses_1f1b": ref_losses, "losses_zb_h1": zb_losses, "grad_norm_1f1b": ref_norm, "grad_norm_zb_h1": zb_norm,
        "grads": {name: {"max_abs_diff": float((zb_grads[name] - g).abs().max()), "max_abs": float(g.abs().max())}
                  for name, g in ref_grads.items()},
        "params_max_abs_diff": max(float((zb_params[n] - p).abs().max()) for n, p in ref_params.items()),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{rank}.json").write_text(json.dumps(report, indent=1))
    setup.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
