"""Tiny random Hugging Face models for the HF import/export tests, built from transformers' config classes (nothing
is downloaded), and the launcher overrides of the same architecture, written out by hand (not derived from the
converter's own config mapping, so a wrong field there shows up as a refused import or different logits)."""
from __future__ import annotations

from pathlib import Path

COMMON = dict(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=16384, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0)
BASE = ["model.vocab_size=200", "model.make_vocab_size_divisible_by=64", "model.hidden_size=64",
        "model.num_layers=2", "model.num_attention_heads=4", "model.seq_length=16", "model.norm_epsilon=1e-5",
        "precision.dtype=fp32", "model.attention_dropout=0.0", "model.hidden_dropout=0.0"]
OURS = [*BASE, "model.num_query_groups=2", "model.max_position_embeddings=16384", "model.normalization=RMSNorm",
        "model.activation=swiglu", "model.position_embedding=rope"]

ARCHS = {
    # Llama 3.1: GQA, untied, RoPE with its llama3 frequency scaling
    "llama": ("LlamaConfig", dict(intermediate_size=96, tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192}),
              ["model.ffn_hidden_size=96", "model.tie_embeddings=false", "model.rotary_base=500000",
               "model.rope_scaling=true", "model.rope_scaling_factor=8"]),
    # Qwen3 dense: per-head q/k RMSNorm, tied embeddings, plain RoPE
    "qwen3": ("Qwen3Config", dict(intermediate_size=96, tie_word_embeddings=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
              ["model.ffn_hidden_size=96", "model.tie_embeddings=true", "model.rotary_base=1000000",
               "model.qk_layernorm=true"]),
    # Mixtral: 4 experts, top-2 softmax routing
    "mixtral": ("MixtralConfig", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                      tie_word_embeddings=False, router_aux_loss_coef=0.0,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
                ["model.ffn_hidden_size=32", "model.moe_ffn_hidden_size=32", "model.num_experts=4",
                 "model.moe_router_topk=2", "model.tie_embeddings=false", "model.rotary_base=1000000"]),
    # Qwen3-MoE: qk-norm and 4 experts, top-2 with renormalised weights
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                         num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
                                         router_aux_loss_coef=0.0,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
                  ["model.ffn_hidden_size=96", "model.moe_ffn_hidden_size=32", "model.num_experts=4",
                   "model.moe_router_topk=2", "model.tie_embeddings=false", "model.rotary_base=1000000",
                   "model.qk_layernorm=true"]),
}
GPT2 = dict(vocab_size=200, n_positions=64, n_embd=64, n_layer=2, n_head=4, n_inner=96, activation_function="gelu",
            layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
            bos_token_id=0, eos_token_id=0)
GPT2_OURS = [*BASE, "model.ffn_hidden_size=96", "model.max_position_embeddings=64", "model.normalization=LayerNorm",
             "model.activation=gelu", "model.position_embedding=learned_absolute", "model.add_bias_linear=true",
             "model.tie_embeddings=true", "model.num_query_groups=null"]
NAMES = ["gpt2", "llama", "mixtral", "qwen3", "qwen3_moe"]
MOE_OURS = ["model.moe_aux_loss_coeff=0.0", "model.moe_router_load_balancing_type=none"]


def overrides(name: str) -> list:
    if name == "gpt2":  # GPT-3 as GPT-2: LayerNorm, exact GeLU, biases, learned positions, tied
        return [*GPT2_OURS, "data=mock"]
    extra = MOE_OURS if "num_experts" in " ".join(ARCHS[name][2]) else []
    return [*OURS, *ARCHS[name][2], *extra, "data=mock"]


def hf_config(name: str, **changes):
    import transformers

    if name == "gpt2":
        return transformers.GPT2Config(**{**GPT2, **changes})
    cls, fields, _ = ARCHS[name]
    return getattr(transformers, cls)(**{**COMMON, **fields, **changes})


def save_random(name: str, out: Path, seed: int = 0):
    """A random HF model of this architecture saved as safetensors; returns the (eval-mode) model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at exactly 1 and would hide a swapped norm: make every weight distinct
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(out))
    return model


def batch(vocab: int = 200, seq: int = 16):
    import torch

    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
