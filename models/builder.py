"""Build Megatron-Core GPTModel chunks from the typed config sections.

``build_model`` returns one chunk per virtual pipeline stage (a list of length 1 without VPP). It must be
called after ``parallel_state.initialize_model_parallel``.

Layout-independent initialisation: with ``use_cpu_initialization`` Megatron draws each TP-sharded weight
at full size from the CPU generator and keeps this rank's slice, so all TP layouts see the same full
weights. To make pipeline layouts agree too, every transformer layer reseeds the generator from its
*global* layer number before building (``SeededTransformerLayer``), and routed experts are re-drawn from
their *global* expert index (``_reseed_experts``). The same full model therefore comes out of TP1xPP1,
TP2xPP2, PP4, PP2xVPP2 or EP2 for a given seed, which is what the parity tests rely on.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
import torch.nn.functional as F

from launcher.core import Layout, derive
from launcher.schema import JobConfig, ModelConfig, ParallelConfig, PrecisionConfig, Recompute, Schedule, ScheduleConfig
from models import backend
from models.seeds import layer_seed
from models.deferred_wgrad import zb_tp_overlap

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""schema.DTYPES -> torch dtype (a test checks the keys are exactly the schema's)."""
ACTIVATIONS = {"swiglu": (F.silu, True), "gelu": (F.gelu, False),
               "squared_relu": (lambda x: torch.pow(F.relu(x), 2), False)}
"""schema.ACTIVATIONS -> (activation_func, gated_linear_unit)."""


def layout_of(*, model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig,
              schedule: Optional[ScheduleConfig] = None) -> Layout:
    """The core's layout for these sections alone (tests and benchmarks that build a model without a job)."""
    return derive(JobConfig(model=model, parallel=parallel, precision=precision,
                            schedule=schedule or ScheduleConfig()))


def transformer_config(*, model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig,
                       layout: Optional[Layout] = None, schedule: Optional[ScheduleConfig] = None,
                       recompute: str = "none", recompute_num_layers: Optional[int] = None,
                       recompute_modules: Optional[List[str]] = None,
                       te: Optional[bool] = None, deterministic: bool = False,
                       cuda_graph_impl: str = "none", cuda_graph_modules: Optional[List[str]] = None,
                       cuda_graph_warmup_steps: int = 3, activation_offload_modules: Optional[List[str]] = None,
                       activation_offload_fraction: float = 1.0, min_offloaded_tensor_size: int = 1 << 20):
    """The megatron.core TransformerConfig (or MLATransformerConfig) for this job (``deterministic``:
    train.deterministic, Megatron-Core's deterministic code paths; ``cuda_graph_*``: train.cuda_graph_*;
    ``activation_offload_*``, ``min_offloaded_tensor_size``: train.*, fine-grained activation offloading)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    layout = layout or layout_of(model=model, parallel=parallel, precision=precision, schedule=schedule)
    te = backend.use_transformer_engine(precision) if te is None else te
    on_gpu = torch.cuda.is_available()
    dtype = DTYPES[precision.dtype]
    if model.activation not in ACTIVATIONS:
        raise ValueError(f"model.activation={model.activation!r}; use one of {sorted(ACTIVATIONS)}")
    activation, gated = ACTIVATIONS[model.activation]
    if parallel.context > 1 and not te:
        raise ValueError(f"parallel.context={parallel.context} needs Transformer Engine attention (GPU); "
                         "use parallel.context=1 on CPU")
    if parallel.tp_comm_overlap and not te:
        raise ValueError("parallel.tp_comm_overlap=true needs Transformer Engine userbuffers (GPU); "
                         "use parallel.tp_comm_overlap=false")
    kwargs = dict(
        num_layers=model.num_layers, hidden_size=model.hidden_size, ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels, normalization=model.normalization, layernorm_epsilon=model.norm_epsilon,
        activation_func=activation, gated_linear_unit=gated, add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias, qk_layernorm=model.qk_layernorm,
        attention_dropout=model.attention_dropout, hidden_dropout=model.hidden_dropout,
        init_method_std=model.init_method_std, mtp_num_layers=model.mtp_num_layers or None,
        # parallel layout
        tensor_model_parallel_size=parallel.tensor, pipeline_model_parallel_size=parallel.pipeline,
        virtual_pipeline_model_parallel_size=_vpp(layout), context_parallel_size=parallel.context,
        expert_model_parallel_size=parallel.expert, expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.sequence_parallel,
        tp_comm_overlap=parallel.tp_comm_overlap,
        num_layers_in_first_pipeline_stage=parallel.first_stage_layers,
        num_layers_in_last_pipeline_stage=parallel.last_stage_layers,
        account_for_embedding_in_pipeline_split=parallel.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=parallel.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=parallel.pipeline_model_parallel_layout,
        overlap_moe_expert_parallel_comm=parallel.moe_a2a_overlap,
        cross_entropy_loss_fusion=model.cross_entropy_loss_fusion, cross_entropy_fusion_impl="native",
        # numerics
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        # CPU: full-size init on the CPU generator (layout-independent); GPU: per-shard init on device
        use_cpu_initialization=not on_gpu, perform_initialization=True,
        # fused kernels: only with Transformer Engine (the local spec's fused softmax needs apex/TE kernels)
        # TE fuses the weight-gradient accumulation into DDP's main_grad buffer (Megatron-LM's default with TE)
        gradient_accumulation_fusion=_grad_accumulation_fusion(parallel, te), bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=te,
        **_activation_rope_fusions(model, te), persist_layer_norm=False, deallocate_pipeline_outputs=on_gpu,
        transformer_impl="transformer_engine" if te else "local", deterministic_mode=deterministic,
        **_recompute_fields(recompute, recompute_num_layers, recompute_modules), **_moe_fields(model, layout, on_gpu),
        **_schedule_fields(layout, schedule, parallel.tp_comm_overlap), **backend.fp8_fields(precision, te),
        # CUDA graphs (train.cuda_graph_*): TransformerConfig turns the module names into CudaGraphModule members
        # (an empty list captures the whole layer); Megatron's "full" default is the deprecated spelling of []
        cuda_graph_impl=cuda_graph_impl, cuda_graph_modules=list(cuda_graph_modules or []),
        cuda_graph_warmup_steps=cuda_graph_warmup_steps,
        # fine-grained activation offloading (train.activation_offload_*): on for a non-empty module list, as
        # Megatron-LM's --fine-grained-activation-offloading needs --offload-modules; GPTModel.forward and the
        # schedules drive PipelineOffloadManager
        fine_grained_activation_offloading=bool(activation_offload_modules),
        offload_modules=list(activation_offload_modules or []),
        activation_offload_fraction=activation_offload_fraction, min_offloaded_tensor_size=min_offloaded_tensor_size,
    )
    if model.multi_latent_attention:
        if not te:
            raise ValueError("model.multi_latent_attention=true needs Transformer Engine attention (GPU): "
                             "Megatron-Core's local DotProductAttention cannot take MLA's separate key/value "
                             "head sizes; use precision.transformer_engine=auto on a GPU cluster")
        kwargs.update(multi_latent_attention=True, q_lora_rank=model.q_lora_rank,
                      kv_lora_rank=model.kv_lora_rank, qk_head_dim=model.qk_head_dim,
                      qk_pos_emb_head_dim=model.qk_pos_emb_head_dim, v_head_dim=model.v_head_dim,
                      rope_type="rope", rotary_base=model.rotary_base, rotary_percent=model.rotary_percent,
                      rotary_scaling_factor=1.0)  # read by yarn only; Megatron-LM's value with --rope-type rope
        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def _grad_accumulation_fusion(parallel: ParallelConfig, te: bool) -> bool:
    """TE accumulates weight gradients straight into DDP's main_grad buffer (Megatron-LM's default with TE).
    Megatron-FSDP takes that only from TE 2.10 on (megatron/core/distributed/fsdp/mcore_fsdp_adapter.py:
    "Megatron-FSDP with gradient_accumulation_fusion requires Transformer Engine version 2.10 or higher"), and
    the image (Dockerfile, NGC PyTorch 25.09) ships an older TE: with FSDP the fusion is on only where the
    installed TE is 2.10 or newer (unfused, TE writes .grad and FSDP reduces it: slower, same numbers)."""
    if not te or not parallel.megatron_fsdp:
        return te
    from megatron.core.utils import is_te_min_version

    try:
        return bool(is_te_min_version("2.10"))
    except Exception:  # noqa: BLE001 - no TE metadata (a CPU test building the GPU config): not fusable
        return False


def _activation_rope_fusions(model: ModelConfig, te: bool) -> dict:
    """Bias-activation and RoPE fusion as Megatron-LM sets them, on the Transformer Engine path.

    - bias_activation_fusion: Megatron-LM's --bias-swiglu-fusion / --bias-gelu-fusion are on by default
      (--no-bias-*-fusion turn them off); SwiGLU takes the first, GeLU the second, which validate_args turns off
      without linear biases ("Disable bias gelu fusion if we are disabling bias altogether",
      megatron/training/arguments.py; megatron/training/argument_utils.py core_transformer_config_from_args).
      squared ReLU has no fused kernel (TransformerConfig: "activation function should be either gelu, swiglu,
      or quick_geglu"), so it stays off.
    - apply_rope_fusion: on by default (--no-rope-fusion), off without RoPE (validate_args: "if
      args.position_embedding_type != 'rope': args.apply_rope_fusion = False"); MLA here uses rope_type
      "rope", for which MLATransformerConfig refuses it ("apply_rope_fusion for MLA only works with YARN
      RoPE"). The kernel is TE's (rope_utils.fused_apply_rotary_pos_emb, None without TE, and
      TransformerConfig then refuses the fusion): on only where it imports.

    The CPU path (local spec, no TE or apex) keeps both off: the fused kernels are TE's / jit fusions made for
    CUDA."""
    if not te:
        return {"bias_activation_fusion": False, "apply_rope_fusion": False}
    from megatron.core.models.common.embeddings import rope_utils

    bias_act = {"swiglu": True, "gelu": model.add_bias_linear}.get(model.activation, False)
    rope = (model.position_embedding == "rope" and not model.multi_latent_attention
            and rope_utils.fused_apply_rotary_pos_emb is not None)
    return {"bias_activation_fusion": bias_act, "apply_rope_fusion": rope}


def _vpp(layout: Layout) -> Optional[int]:
    """Megatron's spelling of "no virtual pipeline" is None, not 1."""
    return layout.vpp if layout.vpp > 1 else None


def _recompute_fields(recompute: str, num_layers: Optional[int], modules: Optional[List[str]] = None) -> dict:
    if recompute in (None, Recompute.NONE):
        return {}
    if recompute == Recompute.SELECTIVE:
        return {"recompute_granularity": "selective", "recompute_modules": list(modules or ["core_attn"])}
    if recompute == Recompute.FULL:
        return {"recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": num_layers or 1}
    raise ValueError(f"train.recompute={recompute!r}; use none, selective or full")


def _moe_fields(model: ModelConfig, layout: Layout, on_gpu: bool) -> dict:
    if not model.num_experts:
        return {}
    pattern = [int(is_moe) for is_moe in layout.moe_pattern]
    return dict(
        num_moe_experts=model.num_experts, moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.ffn_hidden_size,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
        moe_layer_freq=pattern, moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_router_load_balancing_type=model.moe_router_load_balancing_type,
        moe_router_score_function=model.moe_router_score_function,
        moe_token_dispatcher_type=model.moe_token_dispatcher_type,
        moe_flex_dispatcher_backend=model.moe_flex_dispatcher_backend,
        moe_grouped_gemm=model.moe_grouped_gemm and on_gpu,  # grouped GEMM kernels are GPU-only
        moe_router_num_groups=model.moe_router_num_groups, moe_router_group_topk=model.moe_router_group_topk,
        moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor,
        moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
        moe_expert_capacity_factor=model.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=model.moe_pad_expert_input_to_capacity,
    )


def _schedule_fields(layout: Layout, schedule: Optional[ScheduleConfig], tp_comm_overlap: bool = False) -> dict:
    if schedule is None:
        return {}
    fields = {"batch_p2p_comm": schedule.batch_p2p_comm, "overlap_p2p_comm": schedule.overlap_p2p_comm,
              **zb_tp_overlap(schedule.kind, tp_comm_overlap)}  # userbuffer overlaps TE allows with deferred W
    if _vpp(layout):
        fields["microbatch_group_size_per_vp_stage"] = layout.microbatch_group
        if layout.pp == 2 and fields["batch_p2p_comm"] and not fields["overlap_p2p_comm"]:
            # Upstream bug (Megatron-LM #750, #1450): interleaved PP=2 with batched p2p trains silently
            # wrong. Unbatched send/recv is correct.
            fields["batch_p2p_comm"] = False
    if fields["overlap_p2p_comm"]:
        fields["batch_p2p_comm"] = False  # Megatron requires one or the other
    return fields


def seeded_layer_class(seed: int):
    """A TransformerLayer that reseeds the CPU generator from its global layer number before building."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

    class SeededTransformerLayer(TransformerLayer):
        def __init__(self, config, submodules, layer_number: int = 1, *args, **kwargs):
            pgs = kwargs.get("pg_collection")  # Megatron's own source of the rank (ZB-V mirrors it for chunk 1)
            offset = get_transformer_layer_offset(config, kwargs.get("vp_stage"), pgs.pp.rank() if pgs is not None
                                                  else parallel_state.get_pipeline_model_parallel_rank())
            torch.manual_seed(layer_seed(seed, layer_number + offset))
            super().__init__(config, submodules, layer_number, *args, **kwargs)

    return SeededTransformerLayer


def _seed_layers(block_spec, seed: int):
    """Layers (and routed experts) seeded by global position: same weights for every layout."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    mapping = {TransformerLayer: seeded_layer_class(seed), SequentialMLP: seeded_experts_class()}
    return dataclasses.replace(block_spec, layer_specs=[backend.replace_in_spec(s, mapping)
                                                        for s in block_spec.layer_specs])


def seeded_experts_class():
    """SequentialMLP whose routed experts are drawn from their *global* expert index, so any expert-parallel
    split builds the same experts; afterwards the generator is left in a layout-independent state for the
    modules built next (shared experts). Only for expert TP = 1 (unsharded expert weights)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.experts import SequentialMLP

    class SeededSequentialMLP(SequentialMLP):
        def __init__(self, num_local_experts, config, *args, **kwargs):
            before = torch.get_rng_state()
            super().__init__(num_local_experts, config, *args, **kwargs)
            if parallel_state.get_expert_tensor_parallel_world_size() == 1:
                gen = torch.Generator().set_state(before)
                # device="cpu": a seed drawn from the CPU generator, also when the model is built on the meta
                # device (import-hf), where a default-device draw would have no value
                base = int(torch.randint(2**31, (1,), generator=gen, device="cpu"))
                first = parallel_state.get_expert_model_parallel_rank() * num_local_experts
                for i, expert in enumerate(self.local_experts):
                    torch.manual_seed(base + first + i)
                    with torch.no_grad():
                        config.init_method(expert.linear_fc1.weight)
                        config.output_layer_init_method(expert.linear_fc2.weight)
            torch.set_rng_state(before)
            torch.randint(2**31, (1,), device="cpu")  # move on from the state the experts were drawn from

    return SeededSequentialMLP


def gpt_model_kwargs(*, model: ModelConfig, layout: Layout, config, spec, vp_stage: Optional[int],
                     pre_process: bool, post_process: bool, mtp_block_spec=None) -> dict:
    """Keyword arguments of one GPTModel chunk (separate so the wiring test can check them without building)."""
    return dict(
        config=config, transformer_layer_spec=spec, vocab_size=layout.padded_vocab,
        max_sequence_length=model.max_position_embeddings or model.seq_length,
        pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=model.tie_embeddings,
        position_embedding_type=model.position_embedding, rotary_percent=model.rotary_percent,
        rotary_base=int(model.rotary_base), rope_scaling=model.rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor, vp_stage=vp_stage, mtp_block_spec=mtp_block_spec,
    )


def build_model(*, model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig,
                layout: Optional[Layout] = None, schedule: Optional[ScheduleConfig] = None, seed: int = 1234,
                recompute: str = "none", recompute_num_layers: Optional[int] = None,
                recompute_modules: Optional[List[str]] = None, deterministic: bool = False,
                cuda_graph_impl: str = "none", cuda_graph_modules: Optional[List[str]] = None,
                cuda_graph_warmup_steps: int = 3, activation_offload_modules: Optional[List[str]] = None,
                activation_offload_fraction: float = 1.0,
                min_offloaded_tensor_size: int = 1 << 20) -> List[torch.nn.Module]:
    """GPTModel chunk(s) for this rank: one per virtual pipeline stage, on the current device. ``layout`` is
    the job's derived layout (the rank entry passes it; without one it is derived from these sections)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from models.mtp import mtp_block_spec
    from models import deferred_wgrad as zb

    layout = layout or layout_of(model=model, parallel=parallel, precision=precision, schedule=schedule)
    te = backend.use_transformer_engine(precision)
    config = transformer_config(model=model, parallel=parallel, precision=precision, layout=layout,
                                schedule=schedule, recompute=recompute, recompute_num_layers=recompute_num_layers,
                                recompute_modules=recompute_modules,
                                te=te, deterministic=deterministic, cuda_graph_impl=cuda_graph_impl,
                                cuda_graph_modules=cuda_graph_modules, cuda_graph_warmup_steps=cuda_graph_warmup_steps,
                                activation_offload_modules=activation_offload_modules,
                                activation_offload_fraction=activation_offload_fraction,
                                min_offloaded_tensor_size=min_offloaded_tensor_size)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    kind = schedule.kind if schedule is not None else Schedule.ONE_F_ONE_B
    chunks = []
    for vp_stage in range(layout.vpp):
        torch.manual_seed(seed)  # embeddings: the same draw on every rank that builds them
        vp = vp_stage if layout.vpp > 1 else None
        # ZB-V: chunk 1 of rank r is interleaved chunk 1 of rank p - 1 - r (stage 2p - 1 - r): Megatron numbers
        # and builds its layers, and decides pre/post-process, from that rank (zb.v_chunk_pg_collection)
        layer_rank = zb.v_layer_rank(kind, layout.pp, pp_rank, vp_stage)
        spec = _seed_layers(backend.decoder_block_spec(config, te, vp_stage=vp, pp_rank=layer_rank), seed)
        zero_bubble = kind in Schedule.ZERO_BUBBLE
        if zero_bubble:  # split backward: weight gradients deferred into W slots (models/deferred_wgrad.py)
            spec = zb.defer_wgrad_spec(spec, te)
        extra = {"pg_collection": zb.v_chunk_pg_collection(layer_rank)} if layer_rank != pp_rank else {}
        chunk = GPTModel(**gpt_model_kwargs(
            model=model, layout=layout, config=config, spec=spec, vp_stage=vp,
            pre_process=zb.holds_stage(kind, layout.pp, pp_rank, vp_stage, layout.vpp, first=True),
            post_process=zb.holds_stage(kind, layout.pp, pp_rank, vp_stage, layout.vpp, first=False),
            mtp_block_spec=mtp_block_spec(config, spec, te=te, vp_stage=vp, pp_rank=layer_rank, seed=seed)), **extra)
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        if zero_bubble:
            zb.defer_output_layer(chunk)
        chunks.append(chunk)
    return chunks
