"""build_model on CPU (one process, TP=PP=1): each architecture family builds the right Megatron modules
and runs a forward pass with a finite loss; identical seeds give identical weights."""
from __future__ import annotations

import math

import pytest
import torch

from launcher.schema import ModelConfig, ParallelConfig, PrecisionConfig
from _rank_harness import single_process_group

SMALL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=512,
             make_vocab_size_divisible_by=64, seq_length=32)


def build(**model_kw):
    from models import build_model

    single_process_group()
    model = ModelConfig(**{**SMALL, **model_kw})
    [chunk] = build_model(model=model, parallel=ParallelConfig(), precision=PrecisionConfig(dtype="fp32"), seed=3)
    return model, chunk


def forward_loss(model, chunk) -> float:
    tokens = torch.randint(0, model.vocab_size, (2, model.seq_length))
    pos = torch.arange(model.seq_length).expand(2, -1)
    loss = chunk(tokens, pos, None, labels=tokens.roll(-1, 1))
    assert loss.shape == (2, model.seq_length)
    return float(loss.mean())


def test_llama_style():
    from megatron.core.transformer.attention import SelfAttention

    model, chunk = build(num_query_groups=2, normalization="RMSNorm", activation="swiglu",
                         position_embedding="rope", rope_scaling=True, rope_scaling_factor=8.0,
                         rotary_base=500000.0, tie_embeddings=False)
    cfg = chunk.config
    assert cfg.gated_linear_unit and cfg.activation_func is torch.nn.functional.silu
    assert cfg.num_query_groups == 2 and not cfg.add_bias_linear
    layer = chunk.decoder.layers[0]
    assert isinstance(layer.input_layernorm, torch.nn.RMSNorm) and isinstance(layer.self_attention, SelfAttention)
    # fused QKV rows: q (4 heads) + k, v (2 groups each) x 16 dims; gated fc1 = 2 x ffn
    assert layer.self_attention.linear_qkv.weight.shape == ((4 + 2 * 2) * 16, 64)
    assert layer.mlp.linear_fc1.weight.shape == (256, 64)
    assert not chunk.share_embeddings_and_output_weights and chunk.output_layer.weight is not None
    assert chunk.position_embedding_type == "rope" and chunk.rotary_pos_emb.rotary_interleaved is False
    # Llama-3.1 scaling lowers the low-frequency inv_freq values
    _, plain = build(num_query_groups=2, rope_scaling=False, rotary_base=500000.0)
    assert torch.all(chunk.rotary_pos_emb.inv_freq <= plain.rotary_pos_emb.inv_freq + 1e-12)
    assert torch.any(chunk.rotary_pos_emb.inv_freq < plain.rotary_pos_emb.inv_freq * 0.5)
    assert abs(forward_loss(model, chunk) - math.log(512)) < 1.0


def test_gpt3_style():
    model, chunk = build(normalization="LayerNorm", activation="gelu", position_embedding="learned_absolute",
                         add_bias_linear=True, tie_embeddings=True)
    layer = chunk.decoder.layers[0]
    assert isinstance(layer.input_layernorm, torch.nn.LayerNorm)
    assert not chunk.config.gated_linear_unit and layer.mlp.linear_fc1.weight.shape == (128, 64)
    assert layer.mlp.linear_fc1.bias is not None
    assert chunk.embedding.position_embeddings.weight.shape == (32, 64)
    assert chunk.share_embeddings_and_output_weights
    assert math.isfinite(forward_loss(model, chunk))


def test_moe():
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.mlp import MLP

    model, chunk = build(num_layers=3, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                         moe_shared_expert_intermediate_size=64, moe_first_k_dense=1, moe_aux_loss_coeff=0.01)
    layers = chunk.decoder.layers
    assert isinstance(layers[0].mlp, MLP) and not isinstance(layers[0].mlp, MoELayer)  # first_k_dense
    moe = layers[1].mlp
    assert isinstance(moe, MoELayer) and isinstance(layers[2].mlp, MoELayer)
    assert moe.router.topk == 2 and moe.router.weight.shape == (4, 64)
    assert len(moe.experts.local_experts) == 4 and moe.shared_experts is not None
    assert chunk.config.moe_token_dispatcher_type == "alltoall" and chunk.config.moe_grouped_gemm is False
    assert math.isfinite(forward_loss(model, chunk))


def test_mla_config_and_cpu_refusal():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from models.builder import transformer_config

    mla = dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16,
               qk_pos_emb_head_dim=8, v_head_dim=16)
    cfg = transformer_config(model=ModelConfig(**SMALL, **mla), parallel=ParallelConfig(),
                             precision=PrecisionConfig(dtype="bf16"), te=True)
    assert isinstance(cfg, MLATransformerConfig) and cfg.multi_latent_attention
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == \
        (32, 32, 16, 8, 16)
    # upstream's local MLA spec passes k_channels to DotProductAttention, which does not take it
    with pytest.raises(ValueError, match="multi_latent_attention=true needs Transformer Engine"):
        build(**mla)


def test_same_seed_same_weights_different_seed_different():
    _, a = build()
    _, b = build()
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    from models import build_model

    [c] = build_model(model=ModelConfig(**SMALL), parallel=ParallelConfig(), precision=PrecisionConfig(dtype="fp32"),
                      seed=4)
    assert not torch.equal(a.decoder.layers[0].mlp.linear_fc1.weight, c.decoder.layers[0].mlp.linear_fc1.weight)


def test_interleaved_pp2_guard_disables_batched_p2p():
    from launcher.schema import ScheduleConfig
    from models.builder import transformer_config

    cfg = transformer_config(model=ModelConfig(**SMALL), parallel=ParallelConfig(pipeline=2, virtual_pipeline=2),
                             precision=PrecisionConfig(dtype="fp32"), schedule=ScheduleConfig(kind="interleaved"))
    assert cfg.batch_p2p_comm is False and cfg.microbatch_group_size_per_vp_stage == 2
    cfg = transformer_config(model=ModelConfig(**{**SMALL, "num_layers": 4}),
                             parallel=ParallelConfig(pipeline=4, virtual_pipeline=2),
                             precision=PrecisionConfig(dtype="fp32"), schedule=ScheduleConfig(kind="interleaved"))
    assert cfg.batch_p2p_comm is True  # only PP=2 is affected upstream
