"""torchrun worker for tests/test_rank_tp_batch.py: who reads the micro-batches under tensor parallelism.

Usage: torchrun --nproc_per_node=N tests/_tp_batch_worker.py OUT_DIR override [override ...]

Every rank gets a data iterator here (production gives TP ranks > 0 none: ``chunks_reading_data``, reported as
``production_reads``), each counting what is taken from it, so a TP rank that reads shows. Two training steps
through ``Loop.train_step`` record what GPTModel is given per forward call; the same steps then run again on a
fresh model with the former forward step (every TP rank reads its own iterator, all four keys), for the losses.
Writes OUT_DIR/rank-<r>.json: tp/pp rank, reads, the keys each forward call got (None or not) and whether each
tensor equals what this rank's own loader holds at that micro-batch, the losses and grad norms of both runs.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = 2


class Counting:
    """An iterator that counts (and keeps) what is taken from it."""

    def __init__(self, inner):
        self.inner, self.taken = inner, []

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.inner)
        self.taken.append({k: v.clone() for k, v in item.items()})
        return item


def _former_forward_step(data_iterator, model):
    """The forward step before the TP broadcast: each TP rank read its own micro-batch, all four keys."""
    from functools import partial

    from launcher.rank.batch import masked_token_loss
    from models.backend import compute_device

    if data_iterator is None:
        batch = dict.fromkeys(("tokens", "position_ids", "labels", "loss_mask"))
    else:
        batch = {k: v.to(compute_device()) for k, v in next(data_iterator).items()}
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], loss_mask=batch["loss_mask"])
    return out, partial(masked_token_loss, batch["loss_mask"])


def _train(job, layout, cache: Path, former: bool):
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model

    from launcher.rank import training

    tr = job.train
    t = training.build(job, layout)  # production's own build sequence
    model, lp = t.model, t.loop
    if former:
        lp.forward_step = _former_forward_step

    def loaders():
        # a loader on every TP rank: the former forward step read its own, and each rank's own is compared below
        iters, _ = t.iterators(cache_dir=str(cache), every_rank_reads=True)
        return iters

    iters = [Counting(it) for it in loaders()]
    own = [Counting(it) for it in loaders()]  # this rank's own loader: what it would have read itself
    calls = []
    gpt = get_attr_wrapped_model(model[0], "pre_process", return_model_obj=True)
    forward = gpt.forward

    def recording(input_ids, position_ids, attention_mask, *args, **kwargs):
        calls.append({"tokens": input_ids, "position_ids": position_ids, "labels": kwargs.get("labels"),
                      "loss_mask": kwargs.get("loss_mask")})
        return forward(input_ids, position_ids, attention_mask, *args, **kwargs)

    gpt.forward = recording
    results = [lp.train_step(iters) for _ in range(STEPS)]
    for _ in calls:
        next(own[0])
    seen = []
    for call, ref in zip(calls, own[0].taken):
        seen.append({k: None if v is None else bool(torch_equal(v, ref[k])) for k, v in call.items()})
    return {"reads": sum(len(it.taken) for it in iters), "calls": seen,
            "losses": [r["local_loss"] for r in results], "grad_norms": [r["grad_norm"] for r in results],
            "first": bool(gpt.pre_process), "last": bool(gpt.post_process), "mtp": bool(gpt.mtp_process)}


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(a.cpu(), b.to(a.dtype).cpu())


def main() -> int:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    import torch
    from megatron.core import parallel_state as ps

    from launcher.config import compose_job
    from launcher.core import derive
    from launcher.rank import data, setup

    job = compose_job(overrides)
    layout = derive(job)
    setup.init_distributed(cluster=job.cluster, layout=layout, seed=job.train.seed)
    report = {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
              "production_reads": data.chunks_reading_data(1, job.schedule.kind),
              "now": _train(job, layout, out / "cache", former=False),
              "former": _train(job, layout, out / "cache", former=True)}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{torch.distributed.get_rank()}.json").write_text(json.dumps(report, indent=1))
    setup.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
