"""torchrun worker for tests/test_zero_bubble.py's ZB-V checks: one training step of the job as composed (its
schedule.kind: zb_v with two chunks per rank, or 1f1b / interleaved for the reference), then every gradient this
rank holds under its *global* name, so layouts that place the layers differently (the V vs 1F1B) compare.

Usage: torchrun --nproc_per_node=N tests/_zb_v_grad_worker.py OUT_DIR override [override ...]
Writes OUT_DIR/rank-<r>.pt: {"losses": [...], "eval_losses": [...] (zb_v: the forward-only V), "grads" and
"params" (after the optimizer step): {global name: tensor}, "order": [(kind, mb, chunk)...] as executed}
(data-parallel rank 0 only writes grads/params; a TP shard's name carries its TP rank). With
parallel.overlap_grad_reduce (forced on CPU, tests/_zb_grad_worker.py) two steps run and the second is reported.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def global_names(chunks) -> dict:
    """{global name: parameter}: a decoder layer's local index becomes its global layer number - 1."""
    out = {}
    for chunk in chunks:
        gpt = chunk.module
        layers = {str(i): str(layer.layer_number - 1) for i, layer in enumerate(gpt.decoder.layers)}
        for name, param in gpt.named_parameters():
            m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
            out[f"decoder.layers.{layers[m.group(1)]}.{m.group(2)}" if m else name] = param
    return out


def main() -> int:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    import torch
    from megatron.core import parallel_state as ps

    from launcher.config import compose_job
    from launcher.core import derive
    from launcher.rank import loop, setup, training
    from launcher.rank.zb_executor import Recorder
    from launcher.schema import Schedule

    job = compose_job(overrides)
    layout = derive(job)
    steps = 1
    if job.parallel.overlap_grad_reduce:  # on CPU too, and a second step: DDP starts reduces from step 2 on
        from _zb_grad_worker import _overlap_on_cpu

        _overlap_on_cpu(job.parallel)
        steps = 2
    setup.init_distributed(cluster=job.cluster, layout=layout, seed=job.train.seed)
    tr = job.train
    t = training.build(job, layout, loop=False)  # production's own build sequence; the steps driven here
    model, optimizer = t.model, t.optimizer
    iters, _ = t.iterators(cache_dir=str(out / "cache"))
    kind = job.schedule.kind
    forward = loop.forward_step_for(micro_batch_size=tr.micro_batch_size, seq_length=job.model.seq_length)
    recorder = Recorder() if kind in Schedule.ZERO_BUBBLE else None
    kwargs = {"recorder": recorder} if recorder is not None else {}
    for step in range(steps):
        if step:
            optimizer.step()
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        if recorder is not None:
            recorder.start_step()
        losses = loop.schedule_func(kind)(forward_step_func=forward, data_iterator=iters, model=model,
                                          num_microbatches=layout.microbatches, seq_length=job.model.seq_length,
                                          micro_batch_size=tr.micro_batch_size, forward_only=False, **kwargs)
    eval_losses = None
    if kind in Schedule.ZERO_BUBBLE:  # evaluation: the V's forwards alone, or Megatron's function
        iters2, _ = t.iterators(consumed=(steps - 1) * tr.global_batch_size,  # the last step's batches again
                                cache_dir=str(out / "cache"))
        eval_losses = [float(x["lm loss"]) for x in loop.schedule_func(kind)(
            forward_step_func=forward, data_iterator=iters2, model=model,
            num_microbatches=layout.microbatches, seq_length=job.model.seq_length,
            micro_batch_size=tr.micro_batch_size, forward_only=True)]
    rank = torch.distributed.get_rank()
    tp = ps.get_tensor_model_parallel_rank()
    grads, params = {}, {}
    if ps.get_data_parallel_rank() == 0:  # (with the distributed optimizer only this rank's shard is reduced)
        grads = {f"tp{tp}/{name}": p.main_grad.detach().clone() for name, p in global_names(model).items()}
    optimizer.step()
    if ps.get_data_parallel_rank() == 0:
        params = {f"tp{tp}/{name}": p.detach().clone() for name, p in global_names(model).items()}
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"losses": [float(x["lm loss"]) for x in losses], "eval_losses": eval_losses, "grads": grads,
                "params": params, "pp": ps.get_pipeline_model_parallel_rank(), "tp": tp,
                "dp": ps.get_data_parallel_rank(),
                "order": [s[:3] for s in recorder.spans] if recorder else None}, out / f"rank-{rank}.pt")
    setup.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
