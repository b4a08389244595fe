"""Which model fields decide the tensors a checkpoint holds and their shapes (both wings, standard library only).

A checkpoint saved with other values of these cannot be loaded into the model (its tensors have other shapes, or
other tensors exist); any other field (dropout, routing, sequence length with RoPE, the parallel layout, training
settings) leaves the weights loadable, resharded where the layout changed. The ranks' resume
(``launcher/core/checkpoint/directory.py`` plan_resume, ``launcher/rank/checkpoint/store.py`` resume) refuses a checkpoint of
other weights with ``weights_mismatch`` and names the override that continues it (``continue_hint``).

``MODEL_FIELDS`` classifies every ``model.*`` field of the schema (tests/test_weight_fields.py checks it is total,
and builds tiny models that differ in one field to check each class): the ``SHAPES`` fields are compared on resume,
the ``POSITION_TABLE`` and ``MLA_SHAPES`` ones where the model has those tensors (``COMPARED_WHEN``)."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

SHAPES = "shapes"
"""Decides which tensors exist or their shapes: a checkpoint of another value does not load (compared on resume)."""
POSITION_TABLE = "position table"
"""Rows of the learned absolute position table (position_embedding=learned_absolute); no tensor under RoPE or none:
compared on resume only for learned absolute positions (a longer context under RoPE loads)."""
PADDED_ROWS = "padded rows"
"""Pads the embedding and output rows (to a multiple of it x parallel.tensor): what a checkpoint holds is the padded
row count, which a TP change alters too, so the field itself is not compared (equal rows load whatever it is)."""
MLA_SHAPES = "mla shapes"
"""Shapes multi-latent attention's projections (multi_latent_attention=true); no tensor otherwise: compared on resume
only for MLA models."""
INIT_VALUES = "init values"
"""Changes the initial values only; a loaded checkpoint replaces them (not compared)."""
NOT_WEIGHTS = "not weights"
"""Neither the tensors nor their initial values: how the model computes, routes or is named (not compared)."""

MODEL_FIELDS: Dict[str, Tuple[str, str]] = {
    "name": (NOT_WEIGHTS, "a label for logs and reports"),
    "num_layers": (SHAPES, "one set of layer tensors per decoder layer"),
    "hidden_size": (SHAPES, "every weight's model-width dimension"),
    "ffn_hidden_size": (SHAPES, "the dense MLP's fc1/fc2 width"),
    "num_attention_heads": (SHAPES, "the QKV and output projections' rows (heads x head dim)"),
    "num_query_groups": (SHAPES, "the QKV projection's key/value rows"),
    "kv_channels": (SHAPES, "the head dimension of the QKV and output projections"),
    "vocab_size": (SHAPES, "the embedding and output layer's rows"),
    "make_vocab_size_divisible_by": (PADDED_ROWS, "pads the embedding and output rows"),
    "seq_length": (POSITION_TABLE, "the position table's rows when max_position_embeddings is null"),
    "max_position_embeddings": (POSITION_TABLE, "the position table's rows"),
    "normalization": (SHAPES, "LayerNorm has a bias, RMSNorm none"),
    "norm_epsilon": (NOT_WEIGHTS, "a constant inside the norm's computation"),
    "activation": (SHAPES, "swiglu's gated fc1 has twice the rows of gelu's or squared_relu's (and gelu and "
                           "squared_relu weights are another model's)"),
    "position_embedding": (SHAPES, "learned_absolute adds the position table"),
    "rotary_base": (NOT_WEIGHTS, "RoPE's frequencies are computed, not stored"),
    "rotary_percent": (NOT_WEIGHTS, "RoPE's frequencies are computed, not stored"),
    "rope_scaling": (NOT_WEIGHTS, "RoPE's frequencies are computed, not stored"),
    "rope_scaling_factor": (NOT_WEIGHTS, "RoPE's frequencies are computed, not stored"),
    "tie_embeddings": (SHAPES, "untied adds the output layer's own weight"),
    "add_bias_linear": (SHAPES, "adds every linear layer's bias"),
    "add_qkv_bias": (SHAPES, "adds the QKV projection's bias"),
    "qk_layernorm": (SHAPES, "adds the query and key norms' weights"),
    "attention_dropout": (NOT_WEIGHTS, "dropout has no parameters"),
    "hidden_dropout": (NOT_WEIGHTS, "dropout has no parameters"),
    "init_method_std": (INIT_VALUES, "the initial weights' spread"),
    "num_experts": (SHAPES, "adds the router and one MLP per expert"),
    "moe_router_topk": (NOT_WEIGHTS, "how many experts a token uses, not their weights"),
    "moe_ffn_hidden_size": (SHAPES, "each routed expert's fc1/fc2 width"),
    "moe_shared_expert_intermediate_size": (SHAPES, "adds the shared expert's MLP, of this width"),
    "moe_layer_freq": (SHAPES, "which layers hold experts and which a dense MLP"),
    "moe_first_k_dense": (SHAPES, "which layers hold experts and which a dense MLP"),
    "moe_aux_loss_coeff": (NOT_WEIGHTS, "a loss term's weight"),
    "moe_router_load_balancing_type": (NOT_WEIGHTS, "how routing is balanced, not the router's weight"),
    "moe_router_score_function": (NOT_WEIGHTS, "how the router's logits become scores"),
    "moe_token_dispatcher_type": (NOT_WEIGHTS, "how tokens travel to their experts"),
    "moe_flex_dispatcher_backend": (NOT_WEIGHTS, "which kernels move tokens to their experts"),
    "moe_grouped_gemm": (NOT_WEIGHTS, "how the experts' GEMMs run: Megatron-Core's grouped experts write a "
                                      "sharded state dict 'interchangable with SequentialMLP's' "
                                      "(transformer/moe/experts.py TEGroupedMLP.sharded_state_dict)"),
    "moe_router_num_groups": (NOT_WEIGHTS, "which experts a token may reach, not their weights"),
    "moe_router_group_topk": (NOT_WEIGHTS, "which experts a token may reach, not their weights"),
    "moe_router_topk_scaling_factor": (NOT_WEIGHTS, "a factor on the routing weights, computed"),
    "moe_router_enable_expert_bias": (SHAPES, "adds the router's expert_bias buffer (saved)"),
    "moe_expert_capacity_factor": (NOT_WEIGHTS, "which tokens an expert drops"),
    "moe_pad_expert_input_to_capacity": (NOT_WEIGHTS, "the experts' input shapes, not their weights"),
    "multi_latent_attention": (SHAPES, "replaces the QKV projection with MLA's down/up projections"),
    "q_lora_rank": (MLA_SHAPES, "the query down/up projections (null: one query projection)"),
    "kv_lora_rank": (MLA_SHAPES, "the key/value down/up projections' rank"),
    "qk_head_dim": (MLA_SHAPES, "the query/key up projections' rows per head"),
    "qk_pos_emb_head_dim": (MLA_SHAPES, "the RoPE part of the query and key projections"),
    "v_head_dim": (MLA_SHAPES, "the value up projection's rows and the output projection's columns per head"),
    "mtp_num_layers": (SHAPES, "adds the multi-token-prediction layers' tensors"),
    "cross_entropy_loss_fusion": (NOT_WEIGHTS, "how the loss is computed"),
}
"""Every ``model.*`` field: (class, why)."""

WEIGHT_FIELDS = tuple(name for name, (kind, _) in MODEL_FIELDS.items() if kind == SHAPES)
"""The fields always compared on resume (``weights_of`` adds the conditional ones)."""
COMPARED_WHEN = {POSITION_TABLE: ("model.position_embedding", "learned_absolute"),
                 MLA_SHAPES: ("model.multi_latent_attention", True)}
"""Classes compared only where the model has their tensors: (identity key, value that creates them). Elsewhere the
field shapes nothing, and a checkpoint of another value (a longer context under RoPE) loads."""


def weights_of(identity: dict) -> dict:
    """``{'model.<field>': value}`` for the weight fields a run identity (flattened config) records: the ``SHAPES``
    fields, and each ``COMPARED_WHEN`` class whose tensors this model has."""
    kinds = {SHAPES} | {kind for kind, (key, value) in COMPARED_WHEN.items() if identity.get(key) == value}
    names = [name for name, (kind, _) in MODEL_FIELDS.items() if kind in kinds]
    return {f"model.{f}": identity[f"model.{f}"] for f in names if f"model.{f}" in identity}


def weights_mismatch(manifest: dict, identity: dict) -> Optional[str]:
    """The model fields that shape a checkpoint's tensors (recorded by ``import-hf`` as ``weights_of``, read from
    the run identity otherwise) that this job sets differently, or None (a longer context, other dropout or
    routing settings, another layout are fine)."""
    diff = weights_diff(manifest, identity)
    return f"its weights are of another model ({'; '.join(diff)})" if diff else None


def weights_diff(manifest: dict, identity: dict) -> List[str]:
    """``field=theirs there, ours here`` for each weight field a checkpoint's manifest and this job differ in."""
    theirs = manifest.get("weights_of") or weights_of(manifest.get("identity") or {})
    return [f"{k}={v!r} there, {identity.get(k)!r} here" for k, v in sorted(theirs.items()) if identity.get(k) != v]


def continue_hint(manifest: dict, identity: dict) -> str:
    """The override that makes this job the checkpoint's model again (its first differing weight field)."""
    theirs = manifest.get("weights_of") or weights_of(manifest.get("identity") or {})
    for key, value in sorted(theirs.items()):
        if identity.get(key) != value:
            return f"{key}={'null' if value is None else str(value).lower() if isinstance(value, bool) else value}"
    return ""
