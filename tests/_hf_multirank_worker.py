"""One rank of the HF multi-rank check (tests/test_hf_multirank.py), started on 4 CPU processes once for every
catalogue architecture: the rank loops over the architectures, each job's own layout (TP2 x PP2; the MoE ones at
TP2 x PP2 x EP2, expert TP 1), re-initialising Megatron-Core's model-parallel groups in between.

Per architecture, the job's own rank code (``launcher.rank``):
1. builds the model as a job does (``launcher.rank.training.build``: the backend checks,
   ``models.build_model``, Megatron DDP, the Megatron optimizer and scheduler, the model config's hooks) and
   loads the ``import-hf`` checkpoint (written at TP=1) through ``checkpoint.load``'s path
   (``launcher.rank.checkpoint.store.resume``): torch_dist reshards it to the job's layout;
2. computes the logits of a batch (Megatron-Core's forward-only pipeline schedule, the last stage's
   vocab-parallel logits gathered over TP);
3. trains one step (``launcher.rank.loop.Loop.train_step``: the pipeline schedule forward and backward, gradient
   finalisation, Adam) and saves with ``launcher.rank.checkpoint.store.save`` (a checkpoint written at that layout, its
   ``launcher.json`` naming the run's model), then computes the logits again.

Rank 0 of the last stage writes ``OUT/NAME/logits.pt`` ({"import", "trained"}). DeepSeek-V3's MLA needs
Transformer Engine's core attention, which CPU lacks: the rank builds it with the tests' SDPA core attention in its
place (tests/_hf_tiny.py; core attention holds no weights).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def logits(model, tokens):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    seq = tokens.shape[1]

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        out = chunk(batch, torch.arange(seq).expand(batch.shape[0], -1), None)

        def collect(output, non_loss_data=False):  # Megatron's collect_non_loss_data hook (forward_step)
            return gather_from_tensor_model_parallel_region(output)
        return out, collect

    for chunk in model:
        chunk.eval()
    with torch.no_grad():
        out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]), model=model,
                                          num_microbatches=1, seq_length=seq, micro_batch_size=tokens.shape[0],
                                          forward_only=True, collect_non_loss_data=True)
    for chunk in model:
        chunk.train()
    return out[0] if out else None


def training_batch(tokens):
    """The batch as the data loader gives it (launcher/rank/data.py): next-token labels, every token counted."""
    labels = torch.roll(tokens, -1, dims=1)
    return {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(tokens.shape, dtype=torch.float32),
            "position_ids": torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1).contiguous()}


def build(job, layout):
    """The rank's training objects through its own build sequence (``launcher.rank.training.build``); MLA
    (DeepSeek-V3) with the SDPA core attention in place of Transformer Engine's (the config of the TE path, the local
    spec: as launcher.hf.importer.build_single)."""
    from launcher.rank import training

    if not job.model.multi_latent_attention:
        return training.build(job, layout)
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from _hf_tiny import sdpa_core_attention
    from models import backend, builder

    config_of, spec_of = builder.transformer_config, backend.decoder_block_spec

    def te_config(**kw):
        cfg = config_of(**{**kw, "te": True})
        cfg.gradient_accumulation_fusion = False  # a TE kernel
        return cfg

    def sdpa_spec(cfg, te, **kw):
        return backend.replace_in_spec(spec_of(cfg, te, **kw), {DotProductAttention: sdpa_core_attention()})

    builder.transformer_config, backend.decoder_block_spec = te_config, sdpa_spec
    try:
        return training.build(job, layout)
    finally:
        builder.transformer_config, backend.decoder_block_spec = config_of, spec_of


def run_one(name: str, bundle: Path, imported: Path, out: Path) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import multi_token_prediction
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from launcher.core import derive, load_job
    from launcher.core.run_identity import run_identity
    from launcher.rank import setup
    from launcher.rank.checkpoint import store as ckpt

    job = load_job(bundle / "config.yaml")
    layout = derive(job)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    destroy_moe_metrics_tracker()  # sized by the first model built: the next architecture has other layers
    multi_token_prediction.MTPLossLoggingHelper.tracker = {}
    setup.init_distributed(cluster=job.cluster, layout=layout, seed=job.train.seed)
    t = build(job, layout)
    model, optimizer, scheduler, lp = t.model, t.optimizer, t.scheduler, t.loop
    identity = run_identity(job)
    # a job's path: checkpoint.load=<the import> with an empty checkpoint dir (plan, verify, model check, load)
    step, consumed, loaded = ckpt.resume(out / name, identity=identity, load_from=str(imported), checksum=False,
                                         model=model, optimizer=optimizer, scheduler=scheduler, warn=print,
                                         distributed_optimizer=job.parallel.distributed_optimizer)
    assert (step, consumed, loaded) == (0, 0, imported), (name, step, consumed, loaded)
    tokens = torch.load(bundle / "tokens.pt")
    first = logits(model, tokens)
    report = lp.train_step([iter([training_batch(tokens)] * layout.microbatches)])
    assert not report["nonfinite"] and report["grad_norm"] > 0, (name, report)
    ckpt.save(out / name, model=model, optimizer=optimizer, scheduler=scheduler, step=lp.step, consumed=lp.consumed,
              identity=identity)
    second = logits(model, tokens)
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        sizes = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                 ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size())
        torch.save({"import": first, "trained": second, "loss": report["local_loss"], "tp_pp_ep_etp": sizes},
                   out / name / "logits.pt")
    torch.distributed.barrier()


def main() -> None:
    out, plan = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    from launcher.rank import setup

    for name, bundle, imported in plan:
        run_one(name, Path(bundle), Path(imported), out)
        if torch.distributed.get_rank() == 0:
            print(f"hf multirank: {name} done", flush=True)
    setup.close()


if __name__ == "__main__":  # dist_checkpointing.save starts a helper process that imports this module again
    main()
