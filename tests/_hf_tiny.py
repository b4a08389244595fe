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
# DeepSeek-V3: MLA (q and kv latents), 1 dense + 1 MoE layer of 8 experts in 4 groups (top-2 groups, top-4
# experts, sigmoid scores with expert bias, scaling 2.5), one shared expert, one MTP layer
DEEPSEEK = dict(vocab_size=200, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
                qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
                norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rope_interleave=True,
                num_mtp_layers=1, bos_token_id=0, eos_token_id=0)
DEEPSEEK_OURS = [*BASE, "model.norm_epsilon=1e-6", "model.ffn_hidden_size=96", "model.max_position_embeddings=64",
                 "model.num_query_groups=null", "model.normalization=RMSNorm", "model.activation=swiglu",
                 "model.position_embedding=rope", "model.rotary_base=10000", "model.tie_embeddings=false",
                 "model.multi_latent_attention=true", "model.q_lora_rank=32", "model.kv_lora_rank=16",
                 "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=16",
                 "model.qk_layernorm=true",
                 "model.num_experts=8", "model.moe_ffn_hidden_size=32", "model.moe_shared_expert_intermediate_size=32",
                 "model.moe_first_k_dense=1", "model.moe_router_topk=4", "model.moe_router_num_groups=4",
                 "model.moe_router_group_topk=2", "model.moe_router_score_function=sigmoid",
                 "model.moe_router_enable_expert_bias=true", "model.moe_router_topk_scaling_factor=2.5",
                 "model.mtp_num_layers=1"]
NAMES = ["deepseek_v3", "gpt2", "llama", "mixtral", "qwen3", "qwen3_moe"]
MOE_OURS = ["model.moe_aux_loss_coeff=0.0", "model.moe_router_load_balancing_type=none"]


def overrides(name: str) -> list:
    if name == "gpt2":  # GPT-3 as GPT-2: LayerNorm, exact GeLU, biases, learned positions, tied
        return [*GPT2_OURS, "data=mock"]
    if name == "deepseek_v3":
        return [*DEEPSEEK_OURS, *MOE_OURS, "data=mock"]
    extra = MOE_OURS if "num_experts" in " ".join(ARCHS[name][2]) else []
    return [*OURS, *ARCHS[name][2], *extra, "data=mock"]


def hf_config(name: str, **changes):
    import transformers

    if name == "gpt2":
        return transformers.GPT2Config(**{**GPT2, **changes})
    if name == "deepseek_v3":
        return transformers.DeepseekV3Config(**{**DEEPSEEK, **changes})
    cls, fields, _ = ARCHS[name]
    return getattr(transformers, cls)(**{**COMMON, **fields, **changes})


def save_random(name: str, out: Path, seed: int = 0):
    """A random HF model of this architecture saved as safetensors; returns the (eval-mode) model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at exactly 1 (expert biases at 0) and would hide a swap: make them distinct
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
        for key, b in model.named_buffers():
            if key.endswith("e_score_correction_bias"):
                b.add_(0.1 * torch.randn_like(b))
    model.save_pretrained(str(out))
    if name == "deepseek_v3":
        add_mtp_layer(out, model)
    return model


def add_mtp_layer(out: Path, model) -> None:
    """DeepSeek-V3's MTP layer as its HF checkpoints store it (``model.layers.{num_layers}``: enorm, hnorm, eh_proj,
    a decoder layer, shared_head.norm, and copies of the embedding and output layer); transformers' model does not
    build it, so it is added to the saved file, random but for the copies."""
    import torch
    from safetensors.torch import load_file, save_file

    [path] = list(out.glob("*.safetensors"))
    tensors = load_file(str(path))
    n, h = model.config.num_hidden_layers, model.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    mtp = {f"model.layers.{n}." + k[len(f"model.layers.{n - 1}."):]: torch.randn(v.shape, generator=gen) * 0.05
           for k, v in tensors.items() if k.startswith(f"model.layers.{n - 1}.")}
    mtp.update({f"model.layers.{n}.enorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
                f"model.layers.{n}.hnorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
                f"model.layers.{n}.eh_proj.weight": 0.05 * torch.randn(h, 2 * h, generator=gen),
                f"model.layers.{n}.shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
                f"model.layers.{n}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                f"model.layers.{n}.shared_head.head.weight": tensors["lm_head.weight"].clone()})
    save_file({**tensors, **mtp}, str(path), metadata={"format": "pt"})


def sdpa_core_attention():
    """A CPU core attention for MLA in tests (causal softmax(QK^T * scale) V, any key/value head sizes): what
    Transformer Engine's attention computes, so the launcher's DeepSeek-V3 logits can be compared with HF's here."""
    import torch

    class SdpaCoreAttention(torch.nn.Module):
        def __init__(self, *args, softmax_scale=None, **kwargs):
            super().__init__()
            self.scale = softmax_scale

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            s, b, heads = query.shape[:3]
            return out.permute(2, 0, 1, 3).reshape(s, b, heads * value.shape[-1])
    return SdpaCoreAttention


def batch(vocab: int = 200, seq: int = 16):
    import torch

    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
