"""Which model fields decide the tensors a checkpoint holds and their shapes (both wings, standard library only).

A checkpoint saved with other values of these cannot be loaded into the model (its tensors have other shapes, or
other tensors exist); any other field (dropout, routing, sequence length with RoPE, the parallel layout, training
settings) leaves the weights loadable, resharded where the layout changed. The ranks' resume
(``launcher/core/checkpoint_dir.py`` plan_resume, ``launcher/rank/checkpoint.py`` resume) refuses a checkpoint of
other weights with ``weights_mismatch`` and names the override that continues it (``continue_hint``)."""
from __future__ import annotations

from typing import List, Optional

WEIGHT_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "kv_channels", "vocab_size", "normalization", "activation", "position_embedding", "tie_embeddings",
                 "add_bias_linear", "add_qkv_bias", "qk_layernorm", "num_experts", "moe_ffn_hidden_size",
                 "moe_shared_expert_intermediate_size", "moe_first_k_dense", "moe_layer_freq",
                 "moe_router_enable_expert_bias", "multi_latent_attention", "mtp_num_layers")


def weights_of(identity: dict) -> dict:
    """``{'model.<field>': value}`` for the weight fields a run identity (flattened config) records."""
    return {f"model.{f}": identity[f"model.{f}"] for f in WEIGHT_FIELDS if f"model.{f}" in identity}


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
