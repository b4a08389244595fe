"""Training FLOPs per token and per step: Megatron's ``num_floating_point_operations``, reimplemented.

Megatron-LM ``megatron/training/training.py::num_floating_point_operations(args, batch_size)`` counts, for one
global batch of full-length (BSHD) sequences, 3 passes (forward, data-gradient, weight-gradient) x 2 (FMA) x
every GEMM's m*n*k, with causal attention halved. ``flops_per_token`` is that number divided by
``batch_size * seq_length``. Differences from upstream, on purpose: the logit GEMM uses the *unpadded*
vocabulary (as NVIDIA's published TFLOP/s figures do). Pure Python: no torch, no megatron.
"""
from __future__ import annotations

from dataclasses import dataclass

from launcher.core.layout import moe_layer_pattern
from launcher.schema import ModelConfig

FWD_BWD = 3
"""Each GEMM runs three times: forward, backward data-gradient, backward weight-gradient."""
FMA = 2
"""A multiply-accumulate is two floating-point operations."""


def kv_channels(model: ModelConfig) -> int:
    """Per-head dimension (kv_channels, or hidden / heads)."""
    return model.kv_channels or model.hidden_size // model.num_attention_heads


def query_groups(model: ModelConfig) -> int:
    """Key/value heads (num_query_groups, or all heads for MHA)."""
    return model.num_query_groups or model.num_attention_heads


def ffn_factor(model: ModelConfig) -> int:
    """GEMMs per MLP in units of h*ffn: 3 for SwiGLU (gate, up, down), 2 otherwise (up, down)."""
    return 3 if model.activation == "swiglu" else 2


@dataclass(frozen=True)
class LayerFlops:
    """Per-token training FLOPs (fwd+bwd) of one layer's parts; ``attn_core`` is for the full sequence."""

    attn_linear: float
    """QKV (or MLA down/up) and output projections."""
    attn_core: float
    """QK^T and softmax(QK^T)V, causal-halved, per token at the model's seq_length."""
    dense_mlp: float
    """A dense MLP."""
    moe_mlp: float
    """An MoE MLP: top-k routed experts plus shared experts (router GEMM not counted, as upstream)."""


def layer_flops(model: ModelConfig, seq_length: int | None = None) -> LayerFlops:
    """Per-token FLOPs of one transformer layer's parts (training: x3 passes, x2 FMA)."""
    h = model.hidden_size
    s = seq_length or model.seq_length
    n = model.num_attention_heads
    k = FWD_BWD * FMA
    if model.multi_latent_attention:
        qk = model.qk_head_dim + model.qk_pos_emb_head_dim
        if model.q_lora_rank is None:
            q_term = h * n * qk
        else:
            q_term = model.q_lora_rank * (h + n * qk + 1)
        kv_term = model.kv_lora_rank * (h + n * (model.qk_head_dim + model.v_head_dim) + 1)
        attn_linear = k * (q_term + kv_term + h * model.qk_pos_emb_head_dim + n * model.v_head_dim * h)
        attn_core = k * s * (n * qk / 2 + n * model.v_head_dim / 2)
    else:
        d = kv_channels(model)
        q = d * n
        kv = d * query_groups(model)
        attn_linear = k * (h * (q + 2 * kv) + q * h)
        attn_core = k * s * q / 2 * 2  # causal half; QK^T and (QK^T)V
    f = ffn_factor(model)
    dense = k * h * model.ffn_hidden_size * f
    moe = 0.0
    if model.num_experts:
        moe_ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
        shared = model.moe_shared_expert_intermediate_size or 0
        moe = k * h * f * (moe_ffn * model.moe_router_topk + shared)
    return LayerFlops(attn_linear, attn_core, dense, moe)


def flops_per_token(model: ModelConfig) -> float:
    """Training FLOPs (forward + backward) per token at model.seq_length, as Megatron counts them."""
    h = model.hidden_size
    pattern = moe_layer_pattern(model)
    n_moe = sum(pattern)
    n_dense = model.num_layers - n_moe
    mtp = model.mtp_num_layers or 0
    # MTP layers repeat the last decoder layer's kind (Megatron: last_layer_is_moe).
    if pattern and pattern[-1]:
        n_moe += mtp
    else:
        n_dense += mtp
    lf = layer_flops(model)
    k = FWD_BWD * FMA
    total = (
        n_dense * lf.dense_mlp
        + n_moe * lf.moe_mlp
        + (model.num_layers + mtp) * (lf.attn_linear + lf.attn_core)
        + k * mtp * (3 * h + 2 * h * h)  # MTP norms and eh projection
        + k * h * model.vocab_size * (mtp + 1)  # logits (+ one per MTP head), unpadded vocabulary
    )
    return float(total)


def flops_per_step(model: ModelConfig, tokens_per_step: int) -> float:
    """Training FLOPs of one optimizer step of ``tokens_per_step`` tokens (``Layout.tokens_per_step``)."""
    return flops_per_token(model) * tokens_per_step

