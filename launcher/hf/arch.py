"""Which Hugging Face architecture a model entry is, its ``config.json``, and the field-by-field comparison.

The HF config of a model entry is built once (:func:`hf_config`), from transformers' own config classes; import
compares a checkpoint's ``config.json`` with it field by field, so the two directions cannot disagree about what
a field means. Families (transformers/models/<name>/configuration_<name>.py):

- ``llama``: RMSNorm, SwiGLU, RoPE (Llama 3.1's scaling as ``rope_type: llama3``), GQA, untied or tied.
- ``qwen3``: the same with per-head q/k RMSNorm (``qk_layernorm``), no biases.
- ``qwen3_moe``: Qwen3 with routed experts (softmax top-k, no shared expert).
- ``mixtral``: Llama with routed experts (softmax top-k).
- ``deepseek_v3``: MLA, first k layers dense, sigmoid routing with expert bias and groups, a shared expert, MTP.
- ``gpt2``: GPT-3 (LayerNorm with biases, exact GeLU, biases on every linear, learned positions, tied output).
"""
from __future__ import annotations

from typing import List, Optional

from launcher.schema import ModelConfig

# Megatron-Core's Llama 3.x RoPE scaling constants (RotaryEmbedding._apply_scaling defaults,
# megatron/core/models/common/embeddings/rotary_pos_embedding.py): only the factor is a setting.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class Unsupported(ValueError):
    """A model entry this converter has no HF architecture for: one line naming the field."""


def family(model: ModelConfig) -> str:
    """The HF architecture family of a model entry, or Unsupported naming what has none."""
    if model.multi_latent_attention:
        return _deepseek_family(model)
    if model.position_embedding == "learned_absolute":
        return _gpt2_family(model)
    if model.normalization != "RMSNorm" or model.activation != "swiglu" or model.position_embedding != "rope":
        raise Unsupported(f"model.normalization={model.normalization}, model.activation={model.activation}, "
                          f"model.position_embedding={model.position_embedding}: HF conversion covers RMSNorm + "
                          "swiglu + rope (Llama/Qwen3/Mixtral) and LayerNorm + gelu + learned_absolute (GPT-2)")
    if model.mtp_num_layers:
        raise Unsupported(f"model.mtp_num_layers={model.mtp_num_layers}: MTP layers have no HF Llama/Qwen3/Mixtral "
                          "equivalent; use model.mtp_num_layers=0")
    if model.rotary_percent != 1.0:
        raise Unsupported(f"model.rotary_percent={model.rotary_percent}: HF Llama rotates the whole head; "
                          "use model.rotary_percent=1.0")
    if model.add_bias_linear:
        raise Unsupported("model.add_bias_linear=true: HF Llama/Qwen3 have no biases on the MLP; use "
                          "model.add_bias_linear=false")
    if model.num_experts:
        if model.moe_router_score_function != "softmax" or model.moe_router_enable_expert_bias \
                or model.moe_router_num_groups or model.moe_router_topk_scaling_factor not in (None, 1.0):
            raise Unsupported("model.moe_router_score_function=sigmoid / expert bias / group-limited routing "
                              "(DeepSeek-V3 routing): not implemented yet; Mixtral and Qwen3-MoE route with softmax")
        if model.moe_shared_expert_intermediate_size:
            raise Unsupported("model.moe_shared_expert_intermediate_size is set: Mixtral and Qwen3-MoE have no "
                              "shared expert; use null")
        if model.moe_first_k_dense or model.moe_layer_freq != 1:
            raise Unsupported(f"model.moe_first_k_dense={model.moe_first_k_dense}, model.moe_layer_freq="
                              f"{model.moe_layer_freq}: Mixtral and Qwen3-MoE have experts in every layer; use 0 and 1")
        return "qwen3_moe" if model.qk_layernorm else "mixtral"
    if model.qk_layernorm:
        if model.add_qkv_bias:
            raise Unsupported("model.add_qkv_bias=true with qk_layernorm: Qwen3 has no QKV bias; use "
                              "model.add_qkv_bias=false")
        return "qwen3"
    if model.add_qkv_bias:
        raise Unsupported("model.add_qkv_bias=true: HF Llama biases the output projection too (attention_bias); "
                          "use model.add_qkv_bias=false")
    return "llama"


def _deepseek_family(model: ModelConfig) -> str:
    """DeepSeek-V3: what DeepseekV3ForCausalLM can hold (transformers/models/deepseek_v3/modeling_deepseek_v3.py)."""
    want = {"normalization": "RMSNorm", "activation": "swiglu", "position_embedding": "rope",
            "add_bias_linear": False, "add_qkv_bias": False, "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True, "moe_layer_freq": 1, "rope_scaling": False}
    for field, value in want.items():
        if getattr(model, field) != value:
            raise Unsupported(f"model.{field}={getattr(model, field)}: HF's DeepSeek-V3 needs model.{field}={value}")
    if not model.num_experts:
        raise Unsupported("model.num_experts=null: HF's DeepSeek-V3 has routed experts; set model.num_experts")
    groups, group_topk = model.moe_router_num_groups, model.moe_router_group_topk
    if groups and model.moe_router_topk // group_topk != 2:
        # HF ranks groups by the sum of their top-2 scores; Megatron-Core by the top (topk // group_topk)
        # (group_limited_topk, megatron/core/transformer/moe/moe_utils.py)
        raise Unsupported(f"model.moe_router_topk={model.moe_router_topk} with model.moe_router_group_topk="
                          f"{group_topk}: HF's DeepSeek-V3 ranks groups by their top-2 scores, Megatron-Core by the "
                          "top topk // group_topk; use model.moe_router_group_topk="
                          f"{max(1, model.moe_router_topk // 2)}")
    shared, expert = model.moe_shared_expert_intermediate_size or 0, model.moe_ffn_hidden_size or model.ffn_hidden_size
    if shared % expert:
        raise Unsupported(f"model.moe_shared_expert_intermediate_size={shared}: HF counts shared experts of "
                          f"moe_ffn_hidden_size={expert} each; use a multiple of it")
    return "deepseek_v3"


def _gpt2_family(model: ModelConfig) -> str:
    """GPT-3 as HF's GPT-2: what GPT2LMHeadModel can hold (transformers/models/gpt2/modeling_gpt2.py)."""
    want = {"normalization": "LayerNorm", "activation": "gelu", "add_bias_linear": True, "tie_embeddings": True,
            "num_experts": None, "qk_layernorm": False, "mtp_num_layers": 0}
    for field, value in want.items():
        if getattr(model, field) != value:
            raise Unsupported(f"model.{field}={getattr(model, field)}: the GPT-2 architecture (learned positions) "
                              f"needs model.{field}={value}")
    if (model.num_query_groups or model.num_attention_heads) != model.num_attention_heads:
        raise Unsupported(f"model.num_query_groups={model.num_query_groups}: GPT-2 has multi-head attention; use "
                          "model.num_query_groups=null")
    if model.kv_channels not in (None, model.hidden_size // model.num_attention_heads):
        raise Unsupported(f"model.kv_channels={model.kv_channels}: GPT-2's heads are hidden_size / heads = "
                          f"{model.hidden_size // model.num_attention_heads}")
    return "gpt2"


def _rope(model: ModelConfig) -> dict:
    if model.rope_scaling:
        return {"rope_type": "llama3", "rope_theta": float(model.rotary_base),
                "factor": float(model.rope_scaling_factor), **LLAMA3_ROPE}
    return {"rope_type": "default", "rope_theta": float(model.rotary_base)}


def hf_config(model: ModelConfig, *, dtype: str = "float32", bos_token_id: Optional[int] = None,
              eos_token_id: Optional[int] = None):
    """The transformers config object of this model entry (raises Unsupported)."""
    import transformers

    fam = family(model)
    if fam == "gpt2":  # activation "gelu" is the exact erf GELU, Megatron-Core's F.gelu (GPT-2's own is gelu_new)
        return transformers.GPT2Config(
            vocab_size=model.vocab_size, n_positions=model.max_position_embeddings or model.seq_length,
            n_embd=model.hidden_size, n_layer=model.num_layers, n_head=model.num_attention_heads,
            n_inner=model.ffn_hidden_size, activation_function="gelu", layer_norm_epsilon=model.norm_epsilon,
            resid_pdrop=model.hidden_dropout, embd_pdrop=model.hidden_dropout, attn_pdrop=model.attention_dropout,
            initializer_range=model.init_method_std, tie_word_embeddings=True, bos_token_id=bos_token_id,
            eos_token_id=eos_token_id, dtype=dtype)
    if fam == "deepseek_v3":
        return transformers.DeepseekV3Config(
            vocab_size=model.vocab_size, hidden_size=model.hidden_size, intermediate_size=model.ffn_hidden_size,
            moe_intermediate_size=model.moe_ffn_hidden_size or model.ffn_hidden_size,
            num_hidden_layers=model.num_layers,
            num_attention_heads=model.num_attention_heads, num_key_value_heads=model.num_attention_heads,
            n_shared_experts=(model.moe_shared_expert_intermediate_size or 0)
            // (model.moe_ffn_hidden_size or model.ffn_hidden_size), n_routed_experts=model.num_experts,
            routed_scaling_factor=float(model.moe_router_topk_scaling_factor or 1.0),
            kv_lora_rank=model.kv_lora_rank, q_lora_rank=model.q_lora_rank,
            qk_rope_head_dim=model.qk_pos_emb_head_dim, v_head_dim=model.v_head_dim,
            qk_nope_head_dim=model.qk_head_dim, n_group=model.moe_router_num_groups or 1,
            topk_group=model.moe_router_group_topk or 1, num_experts_per_tok=model.moe_router_topk,
            first_k_dense_replace=model.moe_first_k_dense, norm_topk_prob=True,
            max_position_embeddings=model.max_position_embeddings or model.seq_length, rms_norm_eps=model.norm_epsilon,
            tie_word_embeddings=model.tie_embeddings, rope_parameters=_rope(model), rope_interleave=True,
            attention_bias=False, num_mtp_layers=model.mtp_num_layers, attention_dropout=model.attention_dropout,
            initializer_range=model.init_method_std, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
            dtype=dtype)
    common = dict(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size, num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups or model.num_attention_heads,
        head_dim=model.kv_channels or model.hidden_size // model.num_attention_heads,
        max_position_embeddings=model.max_position_embeddings or model.seq_length, rms_norm_eps=model.norm_epsilon,
        rope_parameters=_rope(model), tie_word_embeddings=model.tie_embeddings, hidden_act="silu",
        attention_dropout=model.attention_dropout, initializer_range=model.init_method_std,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, dtype=dtype)
    if fam == "llama":
        return transformers.LlamaConfig(intermediate_size=model.ffn_hidden_size, attention_bias=False,
                                        mlp_bias=False, **common)
    if fam == "qwen3":
        return transformers.Qwen3Config(intermediate_size=model.ffn_hidden_size, attention_bias=False, **common)
    moe = dict(num_experts_per_tok=model.moe_router_topk, router_aux_loss_coef=model.moe_aux_loss_coeff)
    if fam == "mixtral":
        return transformers.MixtralConfig(intermediate_size=model.moe_ffn_hidden_size or model.ffn_hidden_size,
                                          num_local_experts=model.num_experts, **moe, **common)
    # Qwen3-MoE: norm_topk_prob renormalises the top-k softmax weights; Megatron-Core's softmax router with
    # moe_router_pre_softmax=False (its default) takes the softmax over the top-k scores, the same thing.
    return transformers.Qwen3MoeConfig(intermediate_size=model.ffn_hidden_size,
                                       moe_intermediate_size=model.moe_ffn_hidden_size or model.ffn_hidden_size,
                                       num_experts=model.num_experts, norm_topk_prob=True, decoder_sparse_step=1,
                                       mlp_only_layers=[], attention_bias=False, **moe, **common)


# HF config field -> the model entry field it comes from; None: a Megatron-Core constant (no field to change).
COMPARED = {
    "model_type": "model", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_query_groups",
    "head_dim": "kv_channels", "intermediate_size": "ffn_hidden_size", "moe_intermediate_size": "moe_ffn_hidden_size",
    "vocab_size": "vocab_size", "rms_norm_eps": "norm_epsilon", "tie_word_embeddings": "tie_embeddings",
    "num_local_experts": "num_experts", "num_experts": "num_experts", "num_experts_per_tok": "moe_router_topk",
    "rope_theta": "rotary_base", "rope_type": "rope_scaling", "factor": "rope_scaling_factor",
    "low_freq_factor": None, "high_freq_factor": None, "original_max_position_embeddings": None,
    "attention_bias": "add_qkv_bias", "mlp_bias": "add_bias_linear", "norm_topk_prob": None, "hidden_act": "activation",
    # GPT-2's own names (its attribute_map covers hidden_size, layers, heads)
    "n_inner": "ffn_hidden_size", "layer_norm_epsilon": "norm_epsilon", "n_positions": "max_position_embeddings",
    "activation_function": "activation",
    # DeepSeek-V3's
    "kv_lora_rank": "kv_lora_rank", "q_lora_rank": "q_lora_rank", "qk_rope_head_dim": "qk_pos_emb_head_dim",
    "qk_nope_head_dim": "qk_head_dim", "v_head_dim": "v_head_dim", "n_routed_experts": "num_experts",
    "n_shared_experts": "moe_shared_expert_intermediate_size", "first_k_dense_replace": "moe_first_k_dense",
    "n_group": "moe_router_num_groups", "topk_group": "moe_router_group_topk",
    "routed_scaling_factor": "moe_router_topk_scaling_factor", "num_mtp_layers": "mtp_num_layers",
    "rope_interleave": None,
}
_MOE_ONLY = {"num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"}
_ROPE = ("rope_theta", "rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _fields(cfg) -> dict:
    out = {k: getattr(cfg, k, None) for k in COMPARED if k not in _ROPE}
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    out.update(rope_theta=rope.get("rope_theta"), rope_type=rope.get("rope_type", "default"))
    if rope.get("rope_type", "default") != "default":
        out.update({k: rope.get(k) for k in _ROPE[2:]})
    return out


def _close(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(a)))
        except (TypeError, ValueError):
            return False
    return a == b


def _line(key: str, theirs, ours, model: ModelConfig) -> str:
    field = COMPARED[key]
    if key == "model_type":
        return (f"model: the HF config.json is a {theirs!r} model, the model entry makes a {ours!r} one "
                "(qk_layernorm and num_experts decide it); choose a model entry of that architecture")
    if field is None:
        return (f"the HF config.json has {key}={theirs!r}; Megatron-Core fixes it at {ours!r} "
                "(this checkpoint cannot be imported as it is)")
    if key == "rope_type":
        suggest = theirs not in (None, "default")
        if theirs not in (None, "default", "llama3"):
            return (f"model.rope_scaling={model.rope_scaling}: the HF config.json has rope_type={theirs!r}, which "
                    "Megatron-Core's RoPE does not implement (default and llama3 only)")
    elif key in ("hidden_act", "attention_bias", "mlp_bias", "activation_function"):
        return (f"model.{field}={getattr(model, field)!r}: the HF config.json has {key}={theirs!r}, the model "
                f"entry exports {key}={ours!r}; choose a model entry that matches")
    elif key == "n_shared_experts":  # HF counts shared experts, Megatron-Core sums their width
        suggest = (theirs or 0) * (model.moe_ffn_hidden_size or model.ffn_hidden_size) or None
    else:
        suggest = theirs
    return (f"model.{field}={getattr(model, field)!r}: the HF config.json has {key}={theirs!r}; "
            f"try model.{field}={suggest!r}")


def compare(theirs, model: ModelConfig) -> List[str]:
    """One line per field where the HF config ``theirs`` differs from what this model entry would export."""
    try:
        ours = hf_config(model)
    except Unsupported as exc:
        return [str(exc)]
    a, b = _fields(theirs), _fields(ours)
    windowed = getattr(theirs, "use_sliding_window", None) is not False  # Qwen3 keeps a window size it does not use
    window = getattr(theirs, "sliding_window", None) if windowed and theirs.model_type in (
        "mixtral", "qwen3", "qwen3_moe") else None
    early = [f"the HF config.json has sliding_window={window}: Megatron-Core's attention here is full causal "
             "attention; this checkpoint cannot be imported as it is"] if window else []
    moe = bool(model.num_experts) or any(getattr(theirs, k, None) for k in ("num_local_experts", "num_experts"))
    lines = []
    for key in COMPARED:
        if key in _MOE_ONLY and not moe:
            continue
        if key in _ROPE[2:] and not (key in a and key in b):
            continue  # the scaling's own fields: compared when both scale (rope_type says when one does not)
        if not _close(a.get(key), b.get(key)):
            lines.append(_line(key, a.get(key), b.get(key), model))
    return early + lines
