"""Kernel fusions in the TransformerConfig our builder makes, as Megatron-LM sets them (models/builder.py
``_activation_rope_fusions``): on the Transformer Engine path bias-SwiGLU / bias-GeLU and RoPE fusion are on where
Megatron-LM's defaults have them on; on the CPU path (local spec) they stay off. TE is replaced at its import
boundary (as tests/test_models_backend.py does) and TE's fused RoPE kernel by a stand-in, so the GPU branch's
TransformerConfig is built and checked here."""
from __future__ import annotations

import types

import pytest
import torch

from launcher.schema import ModelConfig, ParallelConfig, PrecisionConfig


@pytest.fixture
def gpu_te(monkeypatch):
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401  (Megatron probes TE at first import)
    import megatron.core.transformer.transformer_config  # noqa: F401
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setitem(__import__("sys").modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)  # TE's kernel


def _config(**model):
    from models.builder import transformer_config

    return transformer_config(model=ModelConfig(**model), parallel=ParallelConfig(),
                              precision=PrecisionConfig(dtype="bf16"))


@pytest.mark.parametrize("model, bias_act, rope", [
    (dict(activation="swiglu"), True, True),                              # Llama: Megatron-LM defaults
    (dict(activation="gelu", add_bias_linear=True), True, True),          # GPT-3 style: bias-GeLU fused
    (dict(activation="gelu", add_bias_linear=False), False, True),        # validate_args: no bias, no fusion
    (dict(activation="squared_relu"), False, True),                       # no fused kernel for it
    (dict(activation="swiglu", position_embedding="learned_absolute"), True, False),  # RoPE fusion needs RoPE
])
def test_te_path_fuses_as_megatron_lm(gpu_te, model, bias_act, rope):
    cfg = _config(**model)
    assert cfg.transformer_impl == "transformer_engine"
    assert (cfg.bias_activation_fusion, cfg.apply_rope_fusion) == (bias_act, rope)
    assert cfg.masked_softmax_fusion and cfg.bias_dropout_fusion and cfg.gradient_accumulation_fusion


def test_te_without_its_rope_kernel_keeps_rope_fusion_off(gpu_te, monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    assert _config(activation="swiglu").apply_rope_fusion is False  # TransformerConfig would refuse it


def test_cpu_path_keeps_the_fusions_off(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = _config(activation="gelu", add_bias_linear=True)
    assert cfg.transformer_impl == "local"
    assert not (cfg.bias_activation_fusion or cfg.apply_rope_fusion or cfg.masked_softmax_fusion
                or cfg.bias_dropout_fusion or cfg.gradient_accumulation_fusion)


def test_mla_keeps_rope_fusion_off(gpu_te, monkeypatch):
    """MLATransformerConfig: "apply_rope_fusion for MLA only works with YARN RoPE" (ours is rope_type rope)."""
    from megatron.core.transformer import transformer_config as tc_module

    from launcher.config import compose_job
    from models.builder import transformer_config

    monkeypatch.setattr(tc_module, "is_te_min_version", lambda *a, **k: True)  # MoE + FP8 ask TE's version

    job = compose_job(["recipe=deepseek_v3"])
    cfg = transformer_config(model=job.model, parallel=job.parallel, precision=job.precision)
    assert cfg.multi_latent_attention and cfg.apply_rope_fusion is False and cfg.bias_activation_fusion is True


@pytest.mark.parametrize("te_version, fsdp, fused", [("2.7", True, False), ("2.10", True, True),
                                                      ("2.7", False, True)])
def test_fsdp_fuses_grad_accumulation_only_with_te_2_10(gpu_te, monkeypatch, te_version, fsdp, fused):
    """Megatron-FSDP asserts TE >= 2.10 for gradient_accumulation_fusion (mcore_fsdp_adapter.py); the image's
    NGC 25.09 TE is older, so the derived setting follows the installed TE."""
    from megatron.core import utils

    from models.builder import transformer_config

    monkeypatch.setattr(utils, "is_te_min_version",
                        lambda v, **k: tuple(map(int, te_version.split("."))) >= tuple(map(int, v.split("."))))
    cfg = transformer_config(model=ModelConfig(), parallel=ParallelConfig(megatron_fsdp=fsdp),
                             precision=PrecisionConfig(dtype="bf16"))
    assert cfg.gradient_accumulation_fusion is fused
