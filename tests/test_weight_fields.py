"""``launcher.core.checkpoint.weights.MODEL_FIELDS`` is total and honest: every ``model.*`` schema field is classified, and
for each one a tiny model (CPU GPTModel, one gloo rank, the same seed) built with one field changed shows what the
class says: ``SHAPES``/``POSITION_TABLE``/``PADDED_ROWS`` change the state dict's keys or shapes, ``INIT_VALUES``
only its initial values, ``NOT_WEIGHTS`` nothing at all. Fields that cannot be varied alone on CPU say why."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from launcher.core.checkpoint import weights
from launcher.core.checkpoint.weights import (COMPARED_WHEN, INIT_VALUES, MLA_SHAPES, MODEL_FIELDS, NOT_WEIGHTS, PADDED_ROWS,
                                   POSITION_TABLE, SHAPES, weights_mismatch, weights_of)
from launcher.schema import ModelConfig, ParallelConfig, PrecisionConfig

SMALL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=500,
             make_vocab_size_divisible_by=64, seq_length=32)
"""vocab 500: its padded rows depend on make_vocab_size_divisible_by (512 at 64, 500 at 100)."""
LEARNED = dict(position_embedding="learned_absolute")
MOE = dict(num_experts=4, moe_ffn_hidden_size=32)
GROUPS = dict(MOE, moe_router_num_groups=2, moe_router_group_topk=1)

VARIED = {  # field: (the base it is changed from, its other value)
    "name": ({}, "other"), "num_layers": ({}, 3), "hidden_size": ({}, 128), "ffn_hidden_size": ({}, 256),
    # a fixed head dim: with it derived (hidden / heads), 8 heads of 8 have the QKV rows of 4 heads of 16
    "num_attention_heads": (dict(kv_channels=16), 8),
    "num_query_groups": ({}, 2), "kv_channels": ({}, 32), "vocab_size": ({}, 1000),
    "make_vocab_size_divisible_by": ({}, 100), "seq_length": (LEARNED, 64), "max_position_embeddings": (LEARNED, 64),
    "normalization": ({}, "LayerNorm"), "norm_epsilon": ({}, 1e-6), "activation": ({}, "gelu"),
    "position_embedding": ({}, "learned_absolute"), "rotary_base": ({}, 10000.0), "rotary_percent": ({}, 0.5),
    "rope_scaling": ({}, True), "rope_scaling_factor": (dict(rope_scaling=True), 4.0), "tie_embeddings": ({}, True),
    "add_bias_linear": ({}, True), "add_qkv_bias": ({}, True), "qk_layernorm": ({}, True),
    "attention_dropout": ({}, 0.1), "hidden_dropout": ({}, 0.1), "init_method_std": ({}, 0.01),
    "num_experts": ({}, 4), "moe_router_topk": (MOE, 3), "moe_ffn_hidden_size": (MOE, 16),
    "moe_shared_expert_intermediate_size": (MOE, 64), "moe_layer_freq": (MOE, 2), "moe_first_k_dense": (MOE, 1),
    "moe_aux_loss_coeff": (MOE, 0.01), "moe_router_load_balancing_type": (MOE, "none"),
    "moe_router_score_function": (MOE, "sigmoid"), "moe_token_dispatcher_type": (MOE, "allgather"),
    "moe_router_num_groups": (GROUPS, 4), "moe_router_group_topk": (GROUPS, 2),
    "moe_router_topk_scaling_factor": (MOE, 2.0),
    "moe_router_enable_expert_bias": (dict(MOE, moe_router_score_function="sigmoid"), True),
    "moe_expert_capacity_factor": (MOE, 1.0),
    "moe_pad_expert_input_to_capacity": (dict(MOE, moe_expert_capacity_factor=1.0), True),
    "mtp_num_layers": ({}, 1), "cross_entropy_loss_fusion": ({}, True),
}
_MLA_ON_CPU = ("Megatron-Core's local MLA spec passes k_channels to DotProductAttention, which does not take it: "
               "models/builder.py refuses MLA without Transformer Engine (tests/test_models_build.py)")
NOT_VARIED_ON_CPU = {
    "multi_latent_attention": _MLA_ON_CPU, "q_lora_rank": _MLA_ON_CPU, "kv_lora_rank": _MLA_ON_CPU,
    "qk_head_dim": _MLA_ON_CPU, "qk_pos_emb_head_dim": _MLA_ON_CPU, "v_head_dim": _MLA_ON_CPU,
    "moe_grouped_gemm": "the builder turns grouped GEMM off without a GPU (its kernels are GPU-only), so on CPU the "
                        "field changes nothing by construction",
    "moe_flex_dispatcher_backend": "read only by moe_token_dispatcher_type=flex, whose DeepEP/HybridEP kernels are "
                                   "GPU-only (models/backend.py check_flex_dispatcher)",
}
CHANGES_KEYS_OR_SHAPES = {SHAPES, POSITION_TABLE, PADDED_ROWS, MLA_SHAPES}


def unclassified(model_cls) -> list[str]:
    """The fields of a model config class that MODEL_FIELDS does not classify."""
    return [f.name for f in dataclasses.fields(model_cls) if f.name not in MODEL_FIELDS]


def test_every_model_field_is_classified_with_a_reason():
    assert not unclassified(ModelConfig)
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(MODEL_FIELDS) <= names, set(MODEL_FIELDS) - names  # no entry for a field that is gone
    kinds = {SHAPES, POSITION_TABLE, PADDED_ROWS, MLA_SHAPES, INIT_VALUES, NOT_WEIGHTS}
    assert all(kind in kinds and why.strip() for kind, why in MODEL_FIELDS.values())


def test_a_new_unclassified_field_is_found():
    @dataclasses.dataclass
    class Grown(ModelConfig):
        attention_sink_tokens: int = 0

    assert unclassified(Grown) == ["attention_sink_tokens"]


def test_every_field_is_varied_or_says_why_not():
    both = set(VARIED) & set(NOT_VARIED_ON_CPU)
    neither = set(MODEL_FIELDS) - set(VARIED) - set(NOT_VARIED_ON_CPU)
    assert not both and not neither, (both, neither)


# ------------------------------------------------------------------------------------- the tiny models
@pytest.fixture(scope="module")
def state_of():
    """``state_of(**model_fields)``: the built chunk's state dict (tensors, cloned) for SMALL plus these fields."""
    from _rank_harness import single_process_group
    from models import build_model

    single_process_group()

    def build(**fields):
        [chunk] = build_model(model=ModelConfig(**{**SMALL, **fields}), parallel=ParallelConfig(),
                              precision=PrecisionConfig(dtype="fp32"), seed=3)
        return {k: v.detach().clone() for k, v in chunk.state_dict().items() if isinstance(v, torch.Tensor)}
    return build


def _shapes(state: dict) -> dict:
    return {k: tuple(v.shape) for k, v in state.items()}


def _same_values(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("field", sorted(VARIED))
def test_the_built_model_agrees_with_the_class(field, state_of):
    base, value = VARIED[field]
    kind, why = MODEL_FIELDS[field]
    assert base.get(field, getattr(ModelConfig(**SMALL), field)) != value, "the variant must change the field"
    a, b = state_of(**base), state_of(**{**base, field: value})
    if kind in CHANGES_KEYS_OR_SHAPES:
        assert _shapes(a) != _shapes(b), f"{field} is classified {kind!r} ({why}) but changes no key or shape"
    else:
        assert _shapes(a) == _shapes(b), f"{field} is classified {kind!r} ({why}) but changes keys or shapes: " \
            f"{sorted(set(_shapes(a).items()) ^ set(_shapes(b).items()))}"
        changed = not _same_values(a, b)
        assert changed == (kind == INIT_VALUES), \
            f"{field} is classified {kind!r} ({why}) but {'changes' if changed else 'keeps'} the initial values"


def test_the_position_table_fields_shape_nothing_under_rope(state_of):
    """COMPARED_WHEN's claim: without learned absolute positions a longer context has the same tensors."""
    assert COMPARED_WHEN[POSITION_TABLE] == ("model.position_embedding", "learned_absolute")
    for field in [n for n, (k, _) in MODEL_FIELDS.items() if k == POSITION_TABLE]:
        assert _shapes(state_of(position_embedding="rope")) == _shapes(
            state_of(position_embedding="rope", **{field: 64})), field


# ------------------------------------------------------------------------------------- what resume compares
def _identity(**fields) -> dict:
    return {f"model.{k}": v for k, v in dataclasses.asdict(ModelConfig(**{**SMALL, **fields})).items()}


def test_resume_compares_the_shape_fields_and_the_conditional_ones_where_they_apply():
    rope = weights_of(_identity())
    assert set(rope) == {f"model.{f}" for f in weights.WEIGHT_FIELDS}
    assert "model.seq_length" not in rope and "model.kv_lora_rank" not in rope and "model.name" not in rope
    assert "model.seq_length" in weights_of(_identity(**LEARNED))
    assert "model.kv_lora_rank" in weights_of(_identity(multi_latent_attention=True))
    # a longer context loads under RoPE, not into a learned position table of other rows
    assert weights_mismatch({"identity": _identity()}, _identity(seq_length=64)) is None
    assert "model.seq_length=32 there, 64 here" in weights_mismatch({"identity": _identity(**LEARNED)},
                                                                     _identity(**LEARNED, seq_length=64))
    assert weights_mismatch({"identity": _identity()}, _identity(hidden_dropout=0.1, init_method_std=0.01)) is None
