"""Which model fields decide the tensors a checkpoint holds and their shapes (both wings, standard library only).

A checkpoint saved with other values of these cannot be loaded into the model (its tensors have other shapes, or
other tensors exist); any other field (dropout, routing, sequence length with RoPE, the parallel layout, training
settings) leaves the weights loadable, resharded where the layout changed."""

WEIGHT_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "kv_channels", "vocab_size", "normalization", "activation", "position_embedding", "tie_embeddings",
                 "add_bias_linear", "add_qkv_bias", "qk_layernorm", "num_experts", "moe_ffn_hidden_size",
                 "moe_shared_expert_intermediate_size", "moe_first_k_dense", "moe_layer_freq",
                 "moe_router_enable_expert_bias", "multi_latent_attention", "mtp_num_layers")


def weights_of(identity: dict) -> dict:
    """``{'model.<field>': value}`` for the weight fields a run identity (flattened config) records."""
    return {f"model.{f}": identity[f"model.{f}"] for f in WEIGHT_FIELDS if f"model.{f}" in identity}
