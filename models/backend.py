"""The one seam between the model code and GPU-only libraries (Transformer Engine).

Everything backend-specific is decided here: whether Transformer Engine is used, which layer spec to build,
which TransformerConfig fields carry FP8, and which norm the local (CPU) spec uses. Transformer Engine is
imported lazily, only by :func:`te_available` / :func:`use_transformer_engine`, so the rest of ``models/``
imports on a CPU-only machine. Tests replace ``transformer_engine`` in ``sys.modules`` to exercise the GPU
branch without a GPU.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Dict

import torch

from launcher.core import Layout
from launcher.schema import (FP8_FORMATS, FP8_RECIPES, ModelConfig, ParallelConfig, PrecisionConfig, Schedule,
                             TrainConfig)


def compute_device() -> torch.device:
    """The device this rank computes on: every tensor that reaches a collective or a p2p op is created here
    (``device=compute_device()``). With ``init_process_group(backend="nccl")`` PyTorch binds NCCL to ``cuda``
    tensors only, so a CPU tensor in an all-reduce raises "No backend type associated with device type cpu";
    gloo would accept it, which is why the test suite emulates NCCL's rule (tests/_nccl_emulation.py)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def te_available() -> bool:
    """Transformer Engine importable and a GPU present (TE does not run on CPU)."""
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("transformer_engine")
    except ImportError:
        return False
    return True


def use_transformer_engine(precision: PrecisionConfig) -> bool:
    """Resolve precision.transformer_engine (auto | true | false) against what this process has."""
    choice = str(precision.transformer_engine).lower()
    if choice in ("false", "0", "no", "off"):
        return False
    have = te_available()
    if choice in ("true", "1", "yes", "on") and not have:
        raise RuntimeError("precision.transformer_engine=true but Transformer Engine (with a GPU) is not "
                           "available here; use precision.transformer_engine=auto or false")
    return have


def check_planned_backend(precision: PrecisionConfig, layout: Layout) -> bool:
    """The layer backend this process will build must be the one the login node planned (layout), else the plan
    (memory, FP8, CP attention) describes a different job: refuse with the reason. Returns TE's use."""
    te = use_transformer_engine(precision)
    if layout.transformer_engine and not te:
        raise RuntimeError("this job was planned with Transformer Engine layers (precision.transformer_engine="
                           f"{precision.transformer_engine} on a GPU cluster) but Transformer Engine with a GPU is "
                           "not available in this process; use the GPU image, or precision.transformer_engine=false")
    if te and not layout.transformer_engine:
        raise RuntimeError("Transformer Engine is available here but the job was planned without it "
                           "(cluster.gpu=cpu or precision.transformer_engine=false); re-render for this cluster")
    return te


def check_flex_dispatcher(model) -> None:
    """moe_token_dispatcher_type=flex needs its kernels in this image (DeepEP, or HybridEP from DeepEP's hybrid
    branch): Megatron-Core only finds out when the first MoE layer is built, deep inside model construction."""
    if not model.num_experts or model.moe_token_dispatcher_type != "flex":
        return
    from megatron.core.transformer.moe import fused_a2a

    backend = model.moe_flex_dispatcher_backend
    have = fused_a2a.HAVE_HYBRIDEP if backend == "hybridep" else fused_a2a.HAVE_DEEP_EP
    if not have:
        raise RuntimeError(f"model.moe_token_dispatcher_type=flex with model.moe_flex_dispatcher_backend={backend} "
                           f"needs the {'HybridEP' if backend == 'hybridep' else 'DeepEP'} kernels (the deep_ep "
                           "package) in this image; install them or use model.moe_token_dispatcher_type=alltoall")


def fp8_fields(precision: PrecisionConfig, te: bool) -> Dict[str, Any]:
    """TransformerConfig fields for the FP8 recipe (empty when FP8 is off)."""
    if precision.fp8 is None:
        if precision.fp8_param:
            raise ValueError("precision.fp8_param=true needs precision.fp8 (one of delayed, tensorwise, "
                             "blockwise, mxfp8)")
        return {}
    if not te:
        raise ValueError(f"precision.fp8={precision.fp8!r} needs Transformer Engine on a GPU; "
                         "set precision.fp8=null on CPU")
    if precision.fp8 not in FP8_RECIPES:
        raise ValueError(f"precision.fp8={precision.fp8!r} is not a recipe; use one of {FP8_RECIPES}")
    if precision.fp8_format not in FP8_FORMATS:
        raise ValueError(f"precision.fp8_format={precision.fp8_format!r}; use one of {FP8_FORMATS}")
    fields: Dict[str, Any] = {"fp8": precision.fp8_format, "fp8_recipe": precision.fp8,
                              "fp8_param": precision.fp8_param}
    if precision.fp8 == "delayed":  # amax history only exists for delayed scaling
        fields.update(fp8_amax_history_len=precision.fp8_amax_history_len,
                      fp8_amax_compute_algo=precision.fp8_amax_compute_algo)
    return fields


ZB_UB_CFGS = {"qkv_dgrad": {"method": "pipeline"}, "fc1_dgrad": {"method": "pipeline"}}
"""``initialize_ub``'s ub_cfgs under a zero-bubble schedule, whose column-parallel layers overlap the input
gradient's reduce-scatter with the dgrad GEMM (``tp_comm_overlap_rs_dgrad``, models/deferred_wgrad.py
``ZB_TP_OVERLAP``): TE makes a dgrad buffer a reduce-scatter one (and drops the bulk ``*_wgrad`` buffer) only when
its method is not "bulk" (transformer_engine/pytorch/module/base.py ``initialize_ub``,
``dgrad_reduce_scatter_overlap``); "pipeline" is TE's default method for the forward reduce-scatters."""


def userbuffer_kwargs(*, model: ModelConfig, precision: PrecisionConfig, train: TrainConfig,
                      layout: Layout, schedule_kind: str = Schedule.ONE_F_ONE_B) -> Dict[str, Any]:
    """Arguments of Transformer Engine's ``initialize_ub`` for TP communication overlap, as Megatron-LM's
    ``_initialize_tp_communicators`` computes them: one [tokens per CP rank, hidden] buffer shape; TE's default
    buffers, except the dgrad reduce-scatter ones of a zero-bubble schedule (``ZB_UB_CFGS``)."""
    cfgs = {k: dict(v) for k, v in ZB_UB_CFGS.items()} if schedule_kind in Schedule.ZERO_BUBBLE else None
    return dict(shape=[model.seq_length * train.micro_batch_size // layout.cp, model.hidden_size],
                tp_size=layout.tp, use_fp8=precision.fp8 is not None, ub_cfgs=cfgs, bootstrap_backend="nccl")


def initialize_tp_comm_overlap(*, model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig,
                               train: TrainConfig, layout: Layout, schedule_kind: str = Schedule.ONE_F_ONE_B) -> bool:
    """Set up TE's userbuffers when parallel.tp_comm_overlap (before the model is built, after the process
    groups exist); returns whether it did. TP overlap without TE is refused by validation and here."""
    if not parallel.tp_comm_overlap:
        return False
    if not use_transformer_engine(precision):
        raise RuntimeError("parallel.tp_comm_overlap=true needs Transformer Engine on a GPU; "
                           "set parallel.tp_comm_overlap=false")
    base = importlib.import_module("transformer_engine.pytorch.module.base")
    base.initialize_ub(**userbuffer_kwargs(model=model, precision=precision, train=train, layout=layout,
                                           schedule_kind=schedule_kind))
    return True


class SequenceParallelNorm(torch.nn.Module):
    """torch LayerNorm/RMSNorm for the local spec that also works with sequence parallelism.

    Megatron's WrappedTorchNorm refuses SP because nothing marks its parameters; with SP each TP rank sees a
    different slice of the sequence, so the norm's weight gradients must be all-reduced over TP. Megatron's
    finalize_model_grads does exactly that for parameters carrying ``sequence_parallel=True``.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", bool(config.sequence_parallel))
        return norm


def decoder_block_spec(config, te: bool, vp_stage=None, pp_rank=None):
    """Megatron's GPT decoder block spec for this stage: TE layers on GPU, local layers with an SP-capable
    norm otherwise."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization=config.normalization,
                                      vp_stage=vp_stage, pp_rank=pp_rank)
    return spec if te else _replace_norms(spec)


def _replace_norms(spec):
    """Swap the local spec's torch norm wrappers for SequenceParallelNorm (copying specs)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    mapping = {WrappedTorchNorm: SequenceParallelNorm}
    try:  # apex's FusedLayerNorm may be the local LayerNorm when apex is installed
        from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
        mapping[FusedLayerNorm] = SequenceParallelNorm
    except ImportError:  # pragma: no cover
        pass
    return replace_in_spec(spec, mapping)


def replace_in_spec(spec, mapping: Dict[type, type]):
    """Copy of a (nested) ModuleSpec / submodules dataclass with classes replaced per ``mapping``."""

    def walk(obj):
        if isinstance(obj, type):
            return mapping.get(obj, obj)
        if isinstance(obj, list):
            return [walk(item) for item in obj]
        if isinstance(obj, functools.partial):  # e.g. the MoE experts builder partial(SequentialMLP, ...)
            return functools.partial(walk(obj.func), *obj.args,
                                     **{k: walk(v) for k, v in obj.keywords.items()})
        if dataclasses.is_dataclass(obj):
            changes = {f.name: walk(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
            return dataclasses.replace(obj, **changes)
        return obj

    return walk(spec)
