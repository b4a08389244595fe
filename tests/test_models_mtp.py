"""Multi-token prediction reaches GPTModel (models/mtp.py), checked on CPU with Megatron-Core's local spec.

Before: ``model.mtp_num_layers>0`` set ``TransformerConfig.mtp_num_layers`` but no MTP block spec reached
``GPTModel``, so no MTP layers were built and the loss failed with a shape error.
"""
from __future__ import annotations

import pytest
import torch

from _rank_harness import single_process_group
from launcher.schema import ModelConfig, ParallelConfig, PrecisionConfig

TINY = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=32,
            vocab_size=256, make_vocab_size_divisible_by=64)
SEED = 3


def config(mtp_num_layers: int = 1, **model_kw):
    from models import builder

    single_process_group()
    model = ModelConfig(**{**TINY, **model_kw}, mtp_num_layers=mtp_num_layers)
    cfg = builder.transformer_config(model=model, parallel=ParallelConfig(),
                                     precision=PrecisionConfig(dtype="fp32", transformer_engine="false"))
    return model, cfg


def decoder_spec(cfg):
    """The decoder spec exactly as build_model makes it (local norms swapped, layers seeded)."""
    from models import backend, builder

    return builder._seed_layers(backend.decoder_block_spec(cfg, False), SEED)


def gpt(model, cfg, spec, mtp_spec):
    from launcher.core import padded_vocab
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(SEED)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=padded_vocab(model, 1),
                    max_sequence_length=model.seq_length, position_embedding_type=model.position_embedding,
                    mtp_block_spec=mtp_spec)


def batch(model):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (2, model.seq_length), generator=gen)
    return tokens, torch.arange(model.seq_length).expand(2, -1), tokens.roll(-1, 1)


@pytest.fixture
def cpu_mtp_bridge(monkeypatch):
    """The training forward of MTP calls torch.cuda.current_device() (loss-logging tracker). Until
    models.cpu_compat bridges that module, give it the same CPU ``torch`` proxy here."""
    from megatron.core.transformer import multi_token_prediction
    from models import cpu_compat, mtp

    single_process_group()
    if mtp.MTP_MODULE not in cpu_compat.PATCHED_MODULES:
        monkeypatch.setattr(multi_token_prediction, "torch", cpu_compat.TORCH_ON_CPU)
    monkeypatch.setattr(multi_token_prediction.MTPLossLoggingHelper, "tracker", {})


def test_local_spec_builds_and_trains_mtp(cpu_mtp_bridge):
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from models.mtp import mtp_block_spec

    model, cfg = config()
    spec = decoder_spec(cfg)
    chunk = gpt(model, cfg, spec, mtp_block_spec(cfg, spec, te=False, vp_stage=None, seed=SEED))
    assert isinstance(chunk.mtp, MultiTokenPredictionBlock) and len(chunk.mtp.layers) == 1
    layer = chunk.mtp.layers[0]
    # the local backend's MTP norms are swapped like the decoder's (SP-capable torch norm)
    for norm in (layer.enorm, layer.hnorm, layer.final_layernorm):
        assert type(norm) is torch.nn.RMSNorm and norm.weight.sequence_parallel is False
    assert type(layer.mtp_model_layer) is TransformerLayer

    chunk.train()
    tokens, pos, labels = batch(model)
    loss = chunk(tokens, pos, None, labels=labels)
    assert loss.shape == (2, model.seq_length) and torch.isfinite(loss).all()
    loss.mean().backward()
    mtp_params = {n: p for n, p in chunk.named_parameters() if n.startswith("mtp.")}
    assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight",
            "mtp.layers.0.final_layernorm.weight",
            "mtp.layers.0.mtp_model_layer.self_attention.linear_qkv.weight"} <= set(mtp_params)
    # eh_proj and the MTP layers only feed the MTP loss: non-zero gradients mean that loss is in backward
    for name, param in mtp_params.items():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_mtp_loss_reaches_shared_weights(cpu_mtp_bridge):
    """The MTP loss (scaled by mtp_loss_scaling_factor) adds to the decoder's gradients too."""
    from models.mtp import mtp_block_spec

    grads = []
    for factor in (0.0, 0.1):
        model, cfg = config()
        cfg.mtp_loss_scaling_factor = factor
        spec = decoder_spec(cfg)
        chunk = gpt(model, cfg, spec, mtp_block_spec(cfg, spec, te=False, seed=SEED))
        chunk.train()
        tokens, pos, labels = batch(model)
        chunk(tokens, pos, None, labels=labels).mean().backward()
        grads.append(chunk.decoder.layers[-1].mlp.linear_fc2.weight.grad.clone())
        if factor == 0.0:
            assert chunk.mtp.layers[0].eh_proj.weight.grad.abs().sum() == 0
    assert not torch.allclose(grads[0], grads[1])


def test_without_the_spec_no_mtp_layers_and_the_loss_fails():
    """The old bug: mtp_num_layers set, no spec passed."""
    model, cfg = config()
    chunk = gpt(model, cfg, decoder_spec(cfg), None)
    assert not hasattr(chunk, "mtp") and not any(n.startswith("mtp.") for n, _ in chunk.named_parameters())
    tokens, pos, labels = batch(model)
    with pytest.raises(IndexError, match="shape mismatch"):
        chunk(tokens, pos, None, labels=labels)


def test_none_without_mtp():
    from models.mtp import mtp_block_spec

    _, cfg = config(mtp_num_layers=0)
    assert cfg.mtp_num_layers is None
    assert mtp_block_spec(cfg, decoder_spec(cfg), te=False, vp_stage=None) is None


def test_only_the_last_chunk_of_the_last_stage_holds_mtp(monkeypatch):
    from megatron.core import parallel_state
    from models.mtp import mtp_block_spec

    _, cfg = config()
    spec = decoder_spec(cfg)
    assert mtp_block_spec(cfg, spec, te=False, vp_stage=None) is not None
    # PP=2 seen from rank 0: not the last stage
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda *a, **k: 2)
    assert mtp_block_spec(cfg, spec, te=False, vp_stage=None) is None
    monkeypatch.undo()
    # VPP=2 on the last (only) stage: only virtual chunk 1
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda *a, **k: 2)
    assert mtp_block_spec(cfg, spec, te=False, vp_stage=0) is None
    assert mtp_block_spec(cfg, spec, te=False, vp_stage=1) is not None


def test_mtp_init_is_layout_independent(monkeypatch):
    """MTP depth k is seeded from global position num_layers + k: not from this stage's decoder offset
    (which differs between PP layouts and would repeat decoder layer 1's seed at PP=1)."""
    from megatron.core.transformer import transformer_layer
    from models.mtp import mtp_block_spec

    def weights(chunk):
        return {n: p.detach().clone() for n, p in chunk.named_parameters()
                if n.startswith(("mtp.", "output_layer."))}

    model, cfg = config(tie_embeddings=False)
    spec = decoder_spec(cfg)
    chunk = gpt(model, cfg, spec, mtp_block_spec(cfg, spec, te=False, seed=SEED))
    first = weights(chunk)
    inner = chunk.mtp.layers[0].mtp_model_layer.self_attention.linear_qkv.weight
    assert not torch.equal(inner, chunk.decoder.layers[0].self_attention.linear_qkv.weight)
    # the last stage of a PP=2 layout sees decoder offset 1
    monkeypatch.setattr(transformer_layer, "get_transformer_layer_offset", lambda *a, **k: 1)
    spec = decoder_spec(cfg)  # the builder's seeded layer binds the offset function when made
    chunk = gpt(model, cfg, spec, mtp_block_spec(cfg, spec, te=False, seed=SEED))
    assert not torch.equal(inner, chunk.decoder.layers[0].self_attention.linear_qkv.weight)
    again = weights(chunk)
    assert first.keys() == again.keys() and "output_layer.weight" in first
    for name in first:
        assert torch.equal(first[name], again[name]), name


def test_te_path_asks_megatron_for_te_modules(monkeypatch):
    """On GPU the spec comes from get_gpt_mtp_block_spec(use_transformer_engine=True), norms untouched."""
    from megatron.core.models.gpt import gpt_layer_specs
    from models.mtp import mtp_block_spec

    _, cfg = config()
    calls, sentinel = [], object()

    def fake(config, spec, use_transformer_engine, vp_stage=None, pp_rank=None):
        calls.append(dict(config=config, spec=spec, te=use_transformer_engine, vp_stage=vp_stage, pp_rank=pp_rank))
        return sentinel

    monkeypatch.setattr(gpt_layer_specs, "get_gpt_mtp_block_spec", fake)
    decoder = object()
    assert mtp_block_spec(cfg, decoder, te=True, vp_stage=1, pp_rank=3) is sentinel
    assert calls == [dict(config=cfg, spec=decoder, te=True, vp_stage=1, pp_rank=3)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="documents the CPU-only failure")
def test_supported_on_local_spec_names_the_cpu_blocker(monkeypatch):
    """Documents the one CPU blocker: without the bridge, the training forward raises in MTP's tracker."""
    from megatron.core.transformer import multi_token_prediction
    from models import cpu_compat
    from models.mtp import MTP_MODULE, mtp_block_spec, mtp_supported_on_local_spec

    ok, why = mtp_supported_on_local_spec()
    assert ok == (MTP_MODULE in cpu_compat.PATCHED_MODULES) and why
    if not ok:
        assert "cpu_compat.PATCHED_MODULES" in why

    monkeypatch.setattr(multi_token_prediction, "torch", torch)  # what an unbridged CPU process has
    monkeypatch.setattr(multi_token_prediction.MTPLossLoggingHelper, "tracker", {})
    model, cfg = config()
    spec = decoder_spec(cfg)
    chunk = gpt(model, cfg, spec, mtp_block_spec(cfg, spec, te=False, seed=SEED))
    tokens, pos, labels = batch(model)
    chunk.eval()  # no tracker outside training: works unbridged
    with torch.no_grad():
        assert torch.isfinite(chunk(tokens, pos, None, labels=labels)).all()
    chunk.train()
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA"):
        chunk(tokens, pos, None, labels=labels)
