"""One rank of the HF TP2 x PP2 check (tests/test_hf_multirank.py), started by torchrun on 4 CPU processes.

1. Loads an ``import-hf`` checkpoint (written at TP=1) the way a job's ranks do (``checkpoint.load=`` of a weights-only
   checkpoint: ``launcher.rank.checkpoint.resume``), resharded to TP2 x PP2, and computes the logits of a batch with
   Megatron-Core's forward-only pipeline schedule (the last stage's vocab-parallel logits gathered over TP).
2. Changes every weight in place by an elementwise map (layout-independent: the same numbers on any sharding), saves
   the model with ``dist_checkpointing`` at TP2 x PP2 (a checkpoint written at that layout, for export-hf) and
   computes the logits again.

Rank 0 of the last stage writes both logits; rank 0 writes the new checkpoint's launcher.json (the import's model).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

TRANSFORM = (0.9, 0.01)
"""w -> w * 0.9 + 0.01 on every weight (the test applies the same map to the HF tensors)."""


def logits(chunks, tokens, seq: int):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        pos = torch.arange(seq).expand(batch.shape[0], -1)
        out = model(batch, pos, None)

        def collect(output, non_loss_data=False):  # Megatron's collect_non_loss_data hook (forward_step)
            return gather_from_tensor_model_parallel_region(output)
        return out, collect

    with torch.no_grad():
        out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]), model=chunks,
                                          num_microbatches=1, seq_length=seq, micro_batch_size=tokens.shape[0],
                                          forward_only=True, collect_non_loss_data=True)
    return out[0] if out else None


def main() -> None:
    bundle, imported, out = map(Path, sys.argv[1:4])
    from megatron.core import dist_checkpointing, parallel_state as ps

    from launcher.core import derive, load_job
    from launcher.rank import checkpoint as ckpt, setup
    from models import build_model

    job = load_job(bundle / "config.yaml")
    layout = derive(job)
    setup.init_distributed(cluster=job.cluster, layout=layout, seed=job.train.seed)
    chunks = build_model(model=job.model, parallel=job.parallel, precision=job.precision, layout=layout,
                         seed=job.train.seed)
    # a job's path: checkpoint.load=<the import> with an empty checkpoint.dir (plan, verify, model check, load)
    step, consumed, loaded = ckpt.resume(out / "own", identity=ckpt.run_identity(job), load_from=str(imported),
                                         checksum=False, model=chunks, optimizer=None, scheduler=None, warn=print)
    assert (step, consumed, loaded) == (0, 0, imported), (step, consumed, loaded)
    tokens = torch.load(bundle / "tokens.pt")
    last = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    first = logits(chunks, tokens, tokens.shape[1])
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.mul_(TRANSFORM[0]).add_(TRANSFORM[1])
    target = out / "iter_0000001"
    if torch.distributed.get_rank() == 0:
        target.mkdir(parents=True)
    torch.distributed.barrier()
    dist_checkpointing.save({"model": chunks[0].sharded_state_dict()}, str(target))
    second = logits(chunks, tokens, tokens.shape[1])
    if last:
        torch.save({"import": first, "changed": second}, out / "logits.pt")
    if torch.distributed.get_rank() == 0:
        manifest = json.loads((imported / "launcher.json").read_text())
        manifest.update(step=1, weights_only=True, files={})
        (target / "launcher.json").write_text(json.dumps(manifest))
    torch.distributed.barrier()
    setup.close()


if __name__ == "__main__":  # dist_checkpointing.save starts a helper process that imports this module again
    main()
