"""Weight names and layouts: Megatron-Core's torch_dist checkpoint <-> a Hugging Face causal-LM state dict.

One table of :class:`Unit`s serves both directions. A unit is one Megatron-Core tensor (a checkpoint key, and an
index into its leading expert axis) and the Hugging Face tensors it becomes. Names on the Megatron side are the
*checkpoint* names, which are the Transformer Engine names for both layer specs: the local spec's
``TransformerLayer`` maps ``input_layernorm`` to ``self_attention.linear_qkv.layer_norm_weight`` and
``pre_mlp_layernorm`` to ``mlp.linear_fc1.layer_norm_weight`` when it writes a sharded state dict
(``sharded_state_dict_keys_map``, megatron/core/transformer/transformer_layer.py), exactly the names TE's fused
``TELayerNormColumnParallelLinear`` has. A unit lists the alternatives (a TE MoE layer keeps a separate
``pre_mlp_layernorm``) and the first one present is used.

Layouts (the global tensor of a torch_dist checkpoint is the TP=1 layout, whatever TP it was written at):

- fused QKV with GQA (``SelfAttention.get_query_key_value_tensors``, megatron/core/transformer/attention.py):
  rows ``[ng, heads/ng + 2, head_dim]``: per query group its query heads, then its key head, then its value
  head. HF keeps ``q_proj``/``k_proj``/``v_proj`` apart, query head ``i`` reading key/value head
  ``i // (heads/ng)`` (``repeat_kv``, transformers/models/llama/modeling_llama.py), i.e. the same grouping.
- gated MLP fc1 (``MLP.forward`` with ``gated_linear_unit``: ``chunk(2)``, the first half through the
  activation; ``apply_swiglu_sharded_factory`` in megatron/core/transformer/mlp.py stores every TP rank's first
  halves, then every rank's second halves): ``[gate; up]``.
- embedding and output layer: ``padded_vocab`` rows (``make_vocab_size_divisible_by`` x TP); HF has
  ``vocab_size`` rows: the padding is dropped on export and added (zeros) on import.
- RoPE: Megatron-Core's default (``rotary_interleaved=False``) rotates halves like HF's ``rotate_half``: no
  permutation of the query/key rows.
- routed experts (``SequentialMLP.sharded_state_dict``): ``mlp.experts.experts.linear_fc{1,2}.weight`` with a
  leading expert axis; HF stores one module per expert on disk (transformers 5 fuses them in memory and
  reverses that on save, transformers/conversion_mapping.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence, Tuple

import torch

from launcher.schema import ModelConfig


@dataclass(frozen=True)
class Unit:
    """One Megatron-Core checkpoint tensor and the Hugging Face tensors it holds."""

    mcore: Tuple[str, ...]
    """Checkpoint key(s), per layer (``decoder.layers.{i}.``); the first that the checkpoint/model has is used."""
    index: Tuple[int, ...]
    """Index into the key's leading (expert) axes; () for the whole tensor."""
    hf: Tuple[str, ...]
    """Hugging Face tensor names, in the order ``split`` returns them."""
    split: Callable[[torch.Tensor], Sequence[torch.Tensor]]
    """Megatron tensor -> the HF tensors."""
    join: Callable[[Sequence[torch.Tensor], torch.Size], torch.Tensor]
    """HF tensors (and the Megatron tensor's shape) -> the Megatron tensor."""


def _same(t):
    return (t,)


def _one(ts, shape):
    return ts[0]


def _vocab(rows: int):
    """Embedding / output layer: drop the padded rows on export, add zero rows on import."""
    def split(t):
        return (t[:rows],)

    def join(ts, shape):
        out = torch.zeros(shape, dtype=ts[0].dtype)
        out[:rows] = ts[0]
        return out
    return split, join


def _qkv(heads: int, groups: int, head_dim: int):
    """Fused QKV (weight or bias) <-> q, k, v: Megatron groups rows per query group (see the module doc)."""
    per = heads // groups

    def split(t):
        g = t.reshape(groups, per + 2, head_dim, *t.shape[1:])
        rest = t.shape[1:]
        return (g[:, :per].reshape(heads * head_dim, *rest).contiguous(),
                g[:, per].reshape(groups * head_dim, *rest).contiguous(),
                g[:, per + 1].reshape(groups * head_dim, *rest).contiguous())

    def join(ts, shape):
        q, k, v = ts
        rest = q.shape[1:]
        return torch.cat([q.reshape(groups, per, head_dim, *rest), k.reshape(groups, 1, head_dim, *rest),
                          v.reshape(groups, 1, head_dim, *rest)], dim=1).reshape(shape)
    return split, join


def _gated(t):
    """fc1 of a gated MLP: [gate; up] (see the module doc)."""
    gate, up = torch.chunk(t, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def _cat(ts, shape):
    return torch.cat(list(ts), dim=0)


def head_dim(model: ModelConfig) -> int:
    return model.kv_channels or model.hidden_size // model.num_attention_heads


def moe_layers(model: ModelConfig) -> list:
    """Which decoder layers are MoE: the core's pattern (first k dense, then every moe_layer_freq-th)."""
    from launcher.core.layout import moe_layer_pattern

    return list(moe_layer_pattern(model))


def units(model: ModelConfig) -> list:
    """The mapping of a model entry (arch.family has accepted it): GPT-2's for a GPT-3 entry; Mixtral's MoE names
    without qk-layernorm, Qwen3-MoE's with it."""
    if model.position_embedding == "learned_absolute":
        return gpt2_units(model)
    if model.multi_latent_attention:
        return deepseek_units(model)
    return llama_units(model, moe_names="mixtral" if model.num_experts and not model.qk_layernorm else "qwen")


def llama_units(model: ModelConfig, *, moe_names: str = "qwen") -> list:
    """Llama 3 / 3.1, Qwen3 (qk-norm), Mixtral and Qwen3-MoE: HF's LlamaForCausalLM naming
    (transformers/models/llama/modeling_llama.py), the MoE block as Mixtral (``block_sparse_moe``, ``w1/w3/w2``)
    or Qwen3-MoE (``mlp.gate``, ``mlp.experts.{e}.gate_proj/up_proj/down_proj``) write it to disk."""
    qkv_split, qkv_join = _qkv(model.num_attention_heads, model.num_query_groups or model.num_attention_heads,
                               head_dim(model))
    vsplit, vjoin = _vocab(model.vocab_size)
    units = [Unit(("embedding.word_embeddings.weight",), (), ("model.embed_tokens.weight",), vsplit, vjoin)]
    moe = moe_layers(model) if model.num_experts else [False] * model.num_layers
    for i in range(model.num_layers):
        p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        units += [
            Unit((p + "self_attention.linear_qkv.layer_norm_weight", p + "input_layernorm.weight"), (),
                 (h + "input_layernorm.weight",), _same, _one),
            Unit((p + "self_attention.linear_qkv.weight",), (),
                 tuple(h + f"self_attn.{x}_proj.weight" for x in "qkv"), qkv_split, qkv_join),
            Unit((p + "self_attention.linear_proj.weight",), (), (h + "self_attn.o_proj.weight",), _same, _one),
        ]
        if model.add_qkv_bias or model.add_bias_linear:
            units.append(Unit((p + "self_attention.linear_qkv.bias",), (),
                              tuple(h + f"self_attn.{x}_proj.bias" for x in "qkv"), qkv_split, qkv_join))
        if model.add_bias_linear:
            units.append(Unit((p + "self_attention.linear_proj.bias",), (), (h + "self_attn.o_proj.bias",),
                              _same, _one))
        if model.qk_layernorm:
            units += [Unit((p + f"self_attention.{x}_layernorm.weight",), (), (h + f"self_attn.{x}_norm.weight",),
                           _same, _one) for x in "qk"]
        units.append(Unit((p + "mlp.linear_fc1.layer_norm_weight", p + "pre_mlp_layernorm.weight"), (),
                          (h + "post_attention_layernorm.weight",), _same, _one))
        units += _moe_units(model, p, h, moe_names) if moe[i] else _mlp_units(p + "mlp.", h + "mlp.", model)
    units.append(Unit(("decoder.final_layernorm.weight",), (), ("model.norm.weight",), _same, _one))
    if not model.tie_embeddings:
        units.append(Unit(("output_layer.weight",), (), ("lm_head.weight",), vsplit, vjoin))
    return units


def _mlp_units(p: str, h: str, model: ModelConfig, index=(), names=("gate_proj", "up_proj", "down_proj"),
               mcore_fc=("linear_fc1", "linear_fc2")) -> list:
    out = [Unit((p + mcore_fc[0] + ".weight",), index, (h + names[0] + ".weight", h + names[1] + ".weight"),
                _gated, _cat),
           Unit((p + mcore_fc[1] + ".weight",), index, (h + names[2] + ".weight",), _same, _one)]
    if model.add_bias_linear:
        out += [Unit((p + mcore_fc[0] + ".bias",), index, (h + names[0] + ".bias", h + names[1] + ".bias"),
                     _gated, _cat),
                Unit((p + mcore_fc[1] + ".bias",), index, (h + names[2] + ".bias",), _same, _one)]
    return out


def _moe_units(model: ModelConfig, p: str, h: str, names: str) -> list:
    mixtral = names == "mixtral"
    block = h + ("block_sparse_moe." if mixtral else "mlp.")
    units = [Unit((p + "mlp.router.weight",), (), (block + "gate.weight",), _same, _one)]
    if model.moe_router_enable_expert_bias:
        units.append(Unit((p + "mlp.router.expert_bias",), (), (block + "gate.e_score_correction_bias",),
                          _same, _one))
    experts = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for e in range(model.num_experts):
        units += _mlp_units(p + "mlp.experts.experts.", f"{block}experts.{e}.", model, index=(e,), names=experts)
    if model.moe_shared_expert_intermediate_size:
        units += _mlp_units(p + "mlp.shared_experts.", block + "shared_experts.", model)
    return units


def _conv1d(split_fn, join_fn):
    """HF GPT-2's ``Conv1D`` stores ``[in, out]`` (transformers/pytorch_utils.py), Megatron's linear ``[out, in]``;
    a fused QKV is then ``[q; k; v]`` along ``out`` (``c_attn(x).split(hidden, dim=2)``, modeling_gpt2.py)."""
    def split(t):
        parts = split_fn(t)
        return (torch.cat(list(parts), dim=0).transpose(0, -1).contiguous(),) if t.dim() == 2 \
            else (torch.cat(list(parts), dim=0),)

    def join(ts, shape):
        whole = ts[0].transpose(0, -1) if ts[0].dim() == 2 else ts[0]
        n = len(split_fn(torch.empty(shape, device="meta")))
        return join_fn(torch.chunk(whole, n, dim=0) if n > 1 else (whole,), shape).contiguous()
    return split, join


def gpt2_units(model: ModelConfig) -> list:
    """GPT-3 as HF's GPT2LMHeadModel (transformers/models/gpt2/modeling_gpt2.py): LayerNorm with biases, learned
    positions, biases on every linear, tied output layer, multi-head attention."""
    heads = model.num_attention_heads
    qkv_split, qkv_join = _qkv(heads, heads, head_dim(model))
    vsplit, vjoin = _vocab(model.vocab_size)
    qkv, same = _conv1d(qkv_split, qkv_join), _conv1d(_same, _one)
    units = [Unit(("embedding.word_embeddings.weight",), (), ("transformer.wte.weight",), vsplit, vjoin),
             Unit(("embedding.position_embeddings.weight",), (), ("transformer.wpe.weight",), _same, _one)]
    for i in range(model.num_layers):
        p, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for x in ("weight", "bias"):
            units += [
                Unit((p + f"self_attention.linear_qkv.layer_norm_{x}", p + f"input_layernorm.{x}"), (),
                     (h + f"ln_1.{x}",), _same, _one),
                Unit((p + f"self_attention.linear_qkv.{x}",), (), (h + f"attn.c_attn.{x}",), *qkv),
                Unit((p + f"self_attention.linear_proj.{x}",), (), (h + f"attn.c_proj.{x}",), *same),
                Unit((p + f"mlp.linear_fc1.layer_norm_{x}", p + f"pre_mlp_layernorm.{x}"), (), (h + f"ln_2.{x}",),
                     _same, _one),
                Unit((p + f"mlp.linear_fc1.{x}",), (), (h + f"mlp.c_fc.{x}",), *same),
                Unit((p + f"mlp.linear_fc2.{x}",), (), (h + f"mlp.c_proj.{x}",), *same),
            ]
    units += [Unit((f"decoder.final_layernorm.{x}",), (), (f"transformer.ln_f.{x}",), _same, _one)
              for x in ("weight", "bias")]
    return units


@dataclass(frozen=True)
class Copy(Unit):
    """An HF tensor that repeats another Megatron-Core tensor (DeepSeek-V3's MTP layer carries its own copies of the
    embedding and output layer, which Megatron-Core's MTP shares with the main model): written on export, checked
    equal to the main copy on import."""


def _mla_units(model: ModelConfig, p: str, h: str) -> list:
    """Multi-latent attention (MLASelfAttention, megatron/core/transformer/multi_latent_attention.py) as HF's
    DeepseekV3Attention (transformers/models/deepseek_v3/modeling_deepseek_v3.py): the same projections, in the
    same row orders (q: per head [nope; rope]; kv_a: [kv_lora; rope]; kv_b: per head [k_nope; v]). Both read the
    rope part interleaved (HF ``rope_interleave``, Megatron-Core ``mla_rotary_interleaved`` in rope_utils.py), so no
    rows are permuted. TE fuses the q/kv latent norms into the up projections (``layer_norm_weight``); the local
    spec keeps ``q_layernorm``/``kv_layernorm``."""
    a, ha = p + "self_attention.", h + "self_attn."
    units = [Unit((p + "input_layernorm.weight",), (), (h + "input_layernorm.weight",), _same, _one)]
    if model.q_lora_rank:
        units += [Unit((a + "linear_q_down_proj.weight",), (), (ha + "q_a_proj.weight",), _same, _one),
                  Unit((a + "linear_q_up_proj.layer_norm_weight", a + "q_layernorm.weight"), (),
                       (ha + "q_a_layernorm.weight",), _same, _one),
                  Unit((a + "linear_q_up_proj.weight",), (), (ha + "q_b_proj.weight",), _same, _one)]
    else:
        units.append(Unit((a + "linear_q_proj.weight",), (), (ha + "q_proj.weight",), _same, _one))
    units += [Unit((a + "linear_kv_down_proj.weight",), (), (ha + "kv_a_proj_with_mqa.weight",), _same, _one),
              Unit((a + "linear_kv_up_proj.layer_norm_weight", a + "kv_layernorm.weight"), (),
                   (ha + "kv_a_layernorm.weight",), _same, _one),
              Unit((a + "linear_kv_up_proj.weight",), (), (ha + "kv_b_proj.weight",), _same, _one),
              Unit((a + "linear_proj.weight",), (), (ha + "o_proj.weight",), _same, _one),
              Unit((p + "mlp.linear_fc1.layer_norm_weight", p + "pre_mlp_layernorm.weight"), (),
                   (h + "post_attention_layernorm.weight",), _same, _one)]
    return units


def deepseek_units(model: ModelConfig) -> list:
    """DeepSeek-V3 as HF's DeepseekV3ForCausalLM: MLA, the first k layers dense, then routed experts (router weight
    ``mlp.gate``, expert bias ``mlp.gate.e_score_correction_bias``) and a shared expert; each MTP layer j as HF
    stores DeepSeek-V3's (``model.layers.{num_layers + j}``: ``enorm``, ``hnorm``, ``eh_proj`` on [embedding;
    hidden] like Megatron-Core's ``MultiTokenPredictionLayer``, a decoder layer, ``shared_head.norm`` and copies of
    the embedding and output layer)."""
    vsplit, vjoin = _vocab(model.vocab_size)
    moe = moe_layers(model)
    units = [Unit(("embedding.word_embeddings.weight",), (), ("model.embed_tokens.weight",), vsplit, vjoin)]
    for i in range(model.num_layers):
        p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        units += _mla_units(model, p, h)
        units += _moe_units(model, p, h, "qwen") if moe[i] else _mlp_units(p + "mlp.", h + "mlp.", model)
    units.append(Unit(("decoder.final_layernorm.weight",), (), ("model.norm.weight",), _same, _one))
    if not model.tie_embeddings:
        units.append(Unit(("output_layer.weight",), (), ("lm_head.weight",), vsplit, vjoin))
    for j in range(model.mtp_num_layers or 0):
        p, h = f"mtp.layers.{j}.", f"model.layers.{model.num_layers + j}."
        units += [Unit((p + f"{x}.weight",), (), (h + f"{x}.weight",), _same, _one)
                  for x in ("enorm", "hnorm", "eh_proj")]
        units += _mla_units(model, p + "transformer_layer.", h)
        units += _moe_units(model, p + "transformer_layer.", h, "qwen")
        units += [Unit((p + "final_layernorm.weight",), (), (h + "shared_head.norm.weight",), _same, _one),
                  Copy(("embedding.word_embeddings.weight",), (), (h + "embed_tokens.weight",), vsplit, vjoin),
                  Copy(("embedding.word_embeddings.weight",) if model.tie_embeddings else ("output_layer.weight",), (),
                       (h + "shared_head.head.weight",), vsplit, vjoin)]
    return units


_LAYER_KEY = re.compile(r"^((?:decoder|mtp)\.layers\.\d+\.(?:transformer_layer\.)?)(.*)$")


def te_checkpoint_key(key: str, model: ModelConfig) -> str:
    """The name a Transformer Engine spec's model stores ``key`` (a local-spec checkpoint key) under. The two specs
    name a few norms differently (megatron/core/models/gpt/gpt_layer_specs.py): TE fuses the MLA latent norms into
    the up projections (``linear_q_up_proj``/``linear_kv_up_proj`` ``.layer_norm_weight``) and a dense MLP's norm
    into fc1, and keeps a MoE layer's pre-MLP norm apart (``pre_mlp_layernorm``); the local spec keeps MLA's
    ``q_layernorm``/``kv_layernorm``, stores a standard layer's pre-MLP norm under fc1's fused name even when the
    layer is MoE, and an MLA layer's under ``pre_mlp_layernorm`` even when it is dense."""
    m = _LAYER_KEY.match(key)
    if not m:
        return key
    prefix, rest = m[1], m[2]
    moe = bool(model.num_experts) and (prefix.startswith("mtp.") or moe_layers(model)[int(prefix.split(".")[2])])
    if model.multi_latent_attention:  # standard attention's per-head q/k norms keep their names in both specs
        rest = {"self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
                "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight"
                }.get(rest, rest)
    if moe and rest.startswith("mlp.linear_fc1.layer_norm_"):
        rest = "pre_mlp_layernorm." + rest[len("mlp.linear_fc1.layer_norm_"):]
    if not moe and rest.startswith("pre_mlp_layernorm."):
        rest = "mlp.linear_fc1.layer_norm_" + rest[len("pre_mlp_layernorm."):]
    return prefix + rest
