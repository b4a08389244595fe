"""The GPU/CPU seam (models/backend.py) without a GPU: Transformer Engine is replaced at its import boundary
by a fake module in sys.modules, and torch.cuda.is_available is patched, so the GPU branch's decisions
(TE layer spec, FP8 TransformerConfig fields) are checked on CPU."""
from __future__ import annotations

import types

import pytest
import torch

from launcher.schema import ModelConfig, ParallelConfig, PrecisionConfig
from models import backend


@pytest.fixture
def fake_gpu_with_te(monkeypatch):
    # Megatron itself probes transformer_engine when first imported: import it (real, TE-less) first, so
    # the fake only answers our seam's lazy import.
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.transformer.transformer_config  # noqa: F401

    monkeypatch.setitem(__import__("sys").modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_te_choice(fake_gpu_with_te):
    assert backend.use_transformer_engine(PrecisionConfig(transformer_engine="auto")) is True
    assert backend.use_transformer_engine(PrecisionConfig(transformer_engine="true")) is True
    assert backend.use_transformer_engine(PrecisionConfig(transformer_engine="false")) is False


def test_te_absent_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backend.use_transformer_engine(PrecisionConfig(transformer_engine="auto")) is False
    with pytest.raises(RuntimeError, match="transformer_engine=true"):
        backend.use_transformer_engine(PrecisionConfig(transformer_engine="true"))


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_fp8_recipe_maps_to_transformer_config_fields(fake_gpu_with_te, recipe):
    from models.builder import transformer_config

    precision = PrecisionConfig(dtype="bf16", fp8=recipe, fp8_format="hybrid", fp8_param=True,
                                fp8_amax_history_len=512, fp8_amax_compute_algo="max")
    cfg = transformer_config(model=ModelConfig(), parallel=ParallelConfig(), precision=precision)
    assert (cfg.fp8, cfg.fp8_recipe, cfg.fp8_param) == ("hybrid", recipe, True)
    assert cfg.transformer_impl == "transformer_engine" and cfg.bf16 and cfg.params_dtype == torch.bfloat16
    assert cfg.use_cpu_initialization is False  # on GPU each rank initialises its own shard on device
    if recipe == "delayed":
        assert (cfg.fp8_amax_history_len, cfg.fp8_amax_compute_algo) == (512, "max")
    else:
        assert cfg.fp8_amax_history_len == 1  # Megatron default; amax history is delayed-scaling only


def test_fp8_errors_name_the_field(fake_gpu_with_te):
    with pytest.raises(ValueError, match="precision.fp8='nvfp4'"):
        backend.fp8_fields(PrecisionConfig(fp8="nvfp4"), te=True)
    with pytest.raises(ValueError, match="needs Transformer Engine"):
        backend.fp8_fields(PrecisionConfig(fp8="delayed"), te=False)
    with pytest.raises(ValueError, match="fp8_param"):
        backend.fp8_fields(PrecisionConfig(fp8=None, fp8_param=True), te=True)
    assert backend.fp8_fields(PrecisionConfig(fp8=None), te=True) == {}


def test_gpu_uses_te_layer_spec(fake_gpu_with_te, monkeypatch):
    from megatron.core.models.gpt import gpt_layer_specs

    calls = []
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_decoder_block_spec",
                        lambda config, use_transformer_engine, **kw: calls.append(use_transformer_engine) or "te-spec")
    assert backend.decoder_block_spec(types.SimpleNamespace(normalization="RMSNorm"), te=True) == "te-spec"
    assert calls == [True]


def test_cpu_local_spec_gets_sequence_parallel_norm(monkeypatch):
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from _rank_harness import single_process_group
    from models.builder import _seed_layers, transformer_config

    single_process_group()
    model = ModelConfig(num_layers=2, num_experts=4, moe_shared_expert_intermediate_size=64)
    cfg = transformer_config(model=model, parallel=ParallelConfig(), precision=PrecisionConfig(dtype="fp32"))
    spec = _seed_layers(backend.decoder_block_spec(cfg, te=False), seed=1)
    found = set()

    def walk(obj):
        import dataclasses
        import functools

        if isinstance(obj, type):
            found.add(obj)
        elif isinstance(obj, functools.partial):
            walk(obj.func)
            [walk(v) for v in obj.keywords.values()]
        elif isinstance(obj, list):
            [walk(v) for v in obj]
        elif dataclasses.is_dataclass(obj):
            [walk(getattr(obj, f.name)) for f in dataclasses.fields(obj)]

    walk(spec)
    assert WrappedTorchNorm not in found and SequentialMLP not in found
    assert backend.SequenceParallelNorm in found
    assert any(issubclass(c, SequentialMLP) for c in found if isinstance(c, type))


def test_sequence_parallel_norm_marks_params():
    cfg = types.SimpleNamespace(normalization="RMSNorm", params_dtype=torch.float32, sequence_parallel=True)
    norm = backend.SequenceParallelNorm(cfg, 8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True
    cfg.normalization = "LayerNorm"
    norm = backend.SequenceParallelNorm(cfg, 8)
    assert isinstance(norm, torch.nn.LayerNorm) and all(p.sequence_parallel for p in norm.parameters())


def test_rank_refuses_a_backend_other_than_the_planned_one(monkeypatch):
    from launcher.core import derive
    from launcher.schema import ClusterConfig, JobConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpu_job = JobConfig(cluster=ClusterConfig(gpu="H100", backend="nccl"), precision=PrecisionConfig())
    with pytest.raises(RuntimeError, match="planned with Transformer Engine"):
        backend.check_planned_backend(gpu_job.precision, derive(gpu_job))
    cpu_job = JobConfig(precision=PrecisionConfig(transformer_engine="false"))
    assert backend.check_planned_backend(cpu_job.precision, derive(cpu_job)) is False


def test_gpu_without_te_planned_is_refused_when_te_is_present(fake_gpu_with_te):
    from launcher.core import derive
    from launcher.schema import JobConfig

    job = JobConfig(precision=PrecisionConfig(transformer_engine="auto"))  # cluster.gpu=cpu: planned without TE
    with pytest.raises(RuntimeError, match="planned without it"):
        backend.check_planned_backend(job.precision, derive(job))


def test_flex_dispatcher_without_its_kernels_is_refused_before_the_model_is_built(monkeypatch):
    from megatron.core.transformer.moe import fused_a2a

    from launcher.schema import ModelConfig

    flex = ModelConfig(num_experts=8, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")
    monkeypatch.setattr(fused_a2a, "HAVE_HYBRIDEP", False)
    with pytest.raises(RuntimeError, match="moe_flex_dispatcher_backend=hybridep needs the HybridEP kernels"):
        backend.check_flex_dispatcher(flex)
    monkeypatch.setattr(fused_a2a, "HAVE_HYBRIDEP", True)
    backend.check_flex_dispatcher(flex)  # present: fine
    monkeypatch.setattr(fused_a2a, "HAVE_DEEP_EP", False)
    import dataclasses
    with pytest.raises(RuntimeError, match="DeepEP"):
        backend.check_flex_dispatcher(dataclasses.replace(flex, moe_flex_dispatcher_backend="deepep"))
    backend.check_flex_dispatcher(ModelConfig(num_experts=8))  # alltoall: nothing to check
