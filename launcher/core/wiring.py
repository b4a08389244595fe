"""Where every schema field lands: the Megatron-Core object (and attribute) it configures, or the login node.

One entry per field of ``launcher.schema``; ``tests/test_wiring.py`` fails when a field has none, and, for
every recipe, builds the objects a GPU rank would build and checks each ``Wire`` against them: a wire with
``same=True`` must carry the field's value unchanged; one with ``same=False`` (a value the builder
translates, e.g. ``dtype="bf16"`` -> ``bf16=True``) has its own check in that test.
A field that reaches no rank-side object is ``LOGIN`` (compose, validate, plan, render, submit only).
Torch-free: the login node may read it (help, Megatron-LM argument names).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

TC = "TransformerConfig"
DDP = "DistributedDataParallelConfig"
OPT = "OptimizerConfig"
MPU = "initialize_model_parallel"
GPT = "GPTModel"
SCHED = "OptimizerParamScheduler"
UB = "transformer_engine.initialize_ub"
BUILT = (TC, DDP, OPT, MPU, GPT, SCHED, UB)
"""Targets the wiring test builds (on CPU, for rank 0 of each recipe's real layout) and checks attribute by
attribute. The others are exercised by the training tests."""
DATA = "GPTDatasetConfig / DataLoader"
LOOP = "training loop"
CKPT = "dist_checkpointing save/load"
METRICS = "metrics (rank 0 log, TensorBoard, wandb)"
DIST = "torch.distributed.init_process_group"
LOGIN = "login node only"
POST = "post steps after training (launcher/hf/post.py: export-hf, eval.json)"


@dataclass(frozen=True)
class Wire:
    """One destination of a schema field."""

    target: str
    """A Megatron-Core object (see BUILT), a rank-side stage (DATA, LOOP, ...) or LOGIN."""
    attr: Optional[str] = None
    """The attribute / keyword argument of ``target`` the value lands in."""
    same: bool = True
    """The value lands unchanged (False: translated by the builder; the wiring test checks it explicitly)."""


def _w(target: str, *attrs: str, same: bool = True) -> Tuple[Wire, ...]:
    return tuple(Wire(target, a, same) for a in attrs) or (Wire(target),)


def _tc(*attrs: str, same: bool = True) -> Tuple[Wire, ...]:
    return _w(TC, *attrs, same=same)


WIRING: Dict[str, Tuple[Wire, ...]] = {
    # ---- job
    "name": _w(METRICS, "run_name"), "action": _w(LOGIN), "nodes": _w(LOGIN), "output_dir": _w(LOGIN),
    "force": _w(LOGIN),
    # ---- model
    "model.name": _w(LOGIN),
    "model.num_layers": _tc("num_layers"), "model.hidden_size": _tc("hidden_size"),
    "model.ffn_hidden_size": _tc("ffn_hidden_size"), "model.num_attention_heads": _tc("num_attention_heads"),
    "model.num_query_groups": _tc("num_query_groups", same=False),
    "model.kv_channels": _tc("kv_channels", same=False),
    "model.vocab_size": _w(GPT, "vocab_size", same=False) + _w(DATA, "vocab_size"),
    "model.make_vocab_size_divisible_by": _w(GPT, "vocab_size", same=False),
    "model.seq_length": _w(GPT, "max_sequence_length", same=False) + _w(DATA, "sequence_length")
    + _w(UB, "shape", same=False),
    "model.max_position_embeddings": _w(GPT, "max_sequence_length", same=False),
    "model.normalization": _tc("normalization"), "model.norm_epsilon": _tc("layernorm_epsilon"),
    "model.activation": _tc("activation_func", "gated_linear_unit", same=False),
    "model.position_embedding": _w(GPT, "position_embedding_type"),
    "model.rotary_base": _w(GPT, "rotary_base", same=False), "model.rotary_percent": _w(GPT, "rotary_percent"),
    "model.rope_scaling": _w(GPT, "rope_scaling"), "model.rope_scaling_factor": _w(GPT, "rope_scaling_factor"),
    "model.tie_embeddings": _w(GPT, "share_embeddings_and_output_weights"),
    "model.add_bias_linear": _tc("add_bias_linear"), "model.add_qkv_bias": _tc("add_qkv_bias"),
    "model.qk_layernorm": _tc("qk_layernorm"), "model.attention_dropout": _tc("attention_dropout"),
    "model.hidden_dropout": _tc("hidden_dropout"), "model.init_method_std": _tc("init_method_std"),
    "model.num_experts": _tc("num_moe_experts"), "model.moe_router_topk": _tc("moe_router_topk"),
    "model.moe_ffn_hidden_size": _tc("moe_ffn_hidden_size", same=False),
    "model.moe_shared_expert_intermediate_size": _tc("moe_shared_expert_intermediate_size"),
    "model.moe_layer_freq": _tc("moe_layer_freq", same=False),
    "model.moe_first_k_dense": _tc("moe_layer_freq", same=False),
    "model.moe_aux_loss_coeff": _tc("moe_aux_loss_coeff"),
    "model.moe_router_load_balancing_type": _tc("moe_router_load_balancing_type"),
    "model.moe_router_score_function": _tc("moe_router_score_function"),
    "model.moe_token_dispatcher_type": _tc("moe_token_dispatcher_type"),
    "model.moe_grouped_gemm": _tc("moe_grouped_gemm", same=False),  # GPU only
    "model.moe_flex_dispatcher_backend": _tc("moe_flex_dispatcher_backend"),
    "model.moe_router_num_groups": _tc("moe_router_num_groups"),
    "model.moe_router_group_topk": _tc("moe_router_group_topk"),
    "model.moe_router_topk_scaling_factor": _tc("moe_router_topk_scaling_factor"),
    "model.moe_router_enable_expert_bias": _tc("moe_router_enable_expert_bias"),
    "model.moe_expert_capacity_factor": _tc("moe_expert_capacity_factor"),
    "model.moe_pad_expert_input_to_capacity": _tc("moe_pad_expert_input_to_capacity"),
    "model.multi_latent_attention": _tc("multi_latent_attention"),
    "model.q_lora_rank": _tc("q_lora_rank"), "model.kv_lora_rank": _tc("kv_lora_rank"),
    "model.qk_head_dim": _tc("qk_head_dim"), "model.qk_pos_emb_head_dim": _tc("qk_pos_emb_head_dim"),
    "model.v_head_dim": _tc("v_head_dim"),
    "model.mtp_num_layers": _tc("mtp_num_layers", same=False) + _w(GPT, "mtp_block_spec", same=False),
    "model.cross_entropy_loss_fusion": _tc("cross_entropy_loss_fusion"),
    # ---- parallel
    "parallel.tensor": _w(MPU, "tensor_model_parallel_size") + _tc("tensor_model_parallel_size")
    + _w(UB, "tp_size"),
    "parallel.pipeline": _w(MPU, "pipeline_model_parallel_size") + _tc("pipeline_model_parallel_size"),
    "parallel.virtual_pipeline": _w(MPU, "virtual_pipeline_model_parallel_size", same=False)
    + _tc("virtual_pipeline_model_parallel_size", same=False) + _w(DDP, "align_param_gather", same=False),
    "parallel.context": _w(MPU, "context_parallel_size") + _tc("context_parallel_size")
    + _w(UB, "shape", same=False),
    "parallel.expert": _w(MPU, "expert_model_parallel_size") + _tc("expert_model_parallel_size"),
    "parallel.expert_tensor": _w(MPU, "expert_tensor_parallel_size", same=False)
    + _tc("expert_tensor_parallel_size", same=False),
    "parallel.data": _w(LOGIN),  # an assertion: validation checks it against the derived DP
    "parallel.sequence_parallel": _tc("sequence_parallel", same=False),
    "parallel.distributed_optimizer": _w(DDP, "use_distributed_optimizer") + _w(OPT, "use_distributed_optimizer"),
    "parallel.megatron_fsdp": _w(DDP, "use_megatron_fsdp") + _w(DDP, "data_parallel_sharding_strategy", same=False),
    "parallel.overlap_grad_reduce": _w(DDP, "overlap_grad_reduce", same=False),
    "parallel.overlap_param_gather": _w(DDP, "overlap_param_gather", same=False)
    + _w(OPT, "overlap_param_gather", same=False) + _w(CKPT, "force_param_sync"),
    "parallel.tp_comm_overlap": _tc("tp_comm_overlap") + _w(UB, "called", same=False),
    "parallel.first_stage_layers": _tc("num_layers_in_first_pipeline_stage"),
    "parallel.last_stage_layers": _tc("num_layers_in_last_pipeline_stage"),
    "parallel.account_for_embedding_in_pipeline_split": _tc("account_for_embedding_in_pipeline_split"),
    "parallel.account_for_loss_in_pipeline_split": _tc("account_for_loss_in_pipeline_split"),
    # TransformerConfig parses the string into a PipelineParallelLayerLayout (its repr is the string)
    "parallel.pipeline_model_parallel_layout": _tc("pipeline_model_parallel_layout", same=False),
    "parallel.moe_a2a_overlap": _tc("overlap_moe_expert_parallel_comm"),
    # ---- schedule
    # zero bubble with userbuffer TP overlap: the overlaps TE allows with deferred W (models/deferred_wgrad.py)
    "schedule.kind": _w(LOOP, "forward_backward_func")
    + _tc("tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "tp_comm_overlap_rs_dgrad", same=False)
    + _w(UB, "ub_cfgs", same=False),
    "schedule.microbatch_group_size": _tc("microbatch_group_size_per_vp_stage", same=False),
    "schedule.batch_p2p_comm": _tc("batch_p2p_comm", same=False),
    "schedule.overlap_p2p_comm": _tc("overlap_p2p_comm"),
    "schedule.record_timeline": _w(LOOP, "timeline recorder"),
    "schedule.zb_v_costs": _w(LOOP, "zb_v op order (launcher.core.pipeline.schedules.schedule_zb_v costs)"),
    # ---- precision
    "precision.dtype": _tc("params_dtype", "bf16", "fp16", same=False) + _w(OPT, "params_dtype", "bf16", "fp16", same=False),
    "precision.fp8": _tc("fp8_recipe", same=False) + _w(UB, "use_fp8", same=False) + _w(OPT, "fp8_recipe"),
    "precision.fp8_format": _tc("fp8", same=False),
    "precision.fp8_param": _tc("fp8_param") + _w(DDP, "fp8_param_gather"),
    "precision.fp8_amax_history_len": _tc("fp8_amax_history_len", same=False),
    "precision.fp8_amax_compute_algo": _tc("fp8_amax_compute_algo", same=False),
    "precision.transformer_engine": _tc("transformer_impl", same=False),
    "precision.grad_reduce_in_fp32": _w(DDP, "grad_reduce_in_fp32"),
    "precision.precision_aware_optimizer": _w(OPT, "use_precision_aware_optimizer"),
    **{f"precision.{n}": _w(OPT, n, same=False)  # "bf16" -> torch.bfloat16, "fp8" -> torch.uint8 (Megatron-LM)
       for n in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")},
    # ---- train
    "train.micro_batch_size": _w(LOOP, "micro_batch_size") + _w(DATA, "batch_sampler") + _w(UB, "shape", same=False),
    "train.global_batch_size": _w(LOOP, "num_microbatches") + _w(DATA, "batch_sampler"),
    "train.train_steps": _w(LOOP, "steps") + _w(SCHED, "lr_decay_steps", same=False),
    "train.train_tokens": _w(LOOP, "steps") + _w(SCHED, "lr_decay_steps", same=False),
    "train.lr": _w(OPT, "lr") + _w(SCHED, "max_lr"), "train.min_lr": _w(OPT, "min_lr") + _w(SCHED, "min_lr"),
    "train.lr_schedule": _w(SCHED, "lr_decay_style", same=False),
    "train.warmup_steps": _w(SCHED, "lr_warmup_steps"),
    "train.wsd_decay_steps": _w(SCHED, "wsd_decay_steps", same=False),
    "train.weight_decay": _w(OPT, "weight_decay") + _w(SCHED, "start_wd", "end_wd"),
    "train.adam_beta1": _w(OPT, "adam_beta1"), "train.adam_beta2": _w(OPT, "adam_beta2"),
    "train.adam_eps": _w(OPT, "adam_eps"), "train.clip_grad": _w(OPT, "clip_grad"),
    "train.optimizer_cpu_offload": _w(OPT, "optimizer_cpu_offload"),
    "train.optimizer_offload_fraction": _w(OPT, "optimizer_offload_fraction"),
    "train.overlap_cpu_optimizer_d2h_h2d": _w(OPT, "overlap_cpu_optimizer_d2h_h2d"),
    "train.seed": _w(LOOP, "model_parallel_cuda_manual_seed") + _w(DATA, "random_seed"),
    "train.eval_interval": _w(LOOP, "eval_interval"), "train.eval_iters": _w(LOOP, "eval_iters"),
    "train.recompute": _tc("recompute_granularity", same=False),
    "train.recompute_num_layers": _tc("recompute_num_layers", same=False),
    "train.recompute_modules": _tc("recompute_modules", same=False),
    # CUDA graphs: TransformerConfig decides what the layers capture; the RNG tracker must be graph-safe
    # (setup: model_parallel_cuda_manual_seed(use_cudagraphable_rng / te_rng_tracker)); the transformer_engine
    # implementation is captured by the loop (TECudaGraphHelper at step cuda_graph_warmup_steps)
    "train.cuda_graph_impl": _tc("cuda_graph_impl") + _w(LOOP, "TECudaGraphHelper") + _w(LOOP, "rng tracker"),
    "train.cuda_graph_modules": _tc("cuda_graph_modules", same=False),  # names -> CudaGraphModule members
    "train.cuda_graph_warmup_steps": _tc("cuda_graph_warmup_steps") + _w(LOOP, "TECudaGraphHelper"),
    # fine-grained activation offloading: TransformerConfig turns it on for a non-empty module list; GPTModel's
    # forward and Megatron-Core's schedules drive the offload manager (no loop code of ours)
    "train.activation_offload_modules": _tc("offload_modules") + _tc("fine_grained_activation_offloading", same=False),
    "train.activation_offload_fraction": _tc("activation_offload_fraction"),
    "train.min_offloaded_tensor_size": _tc("min_offloaded_tensor_size"),
    "train.exit_after_minutes": _w(LOOP, "deadline"),
    "train.nonfinite": _w(LOOP, "nonfinite"), "train.straggler_interval": _w(LOOP, "straggler_interval"),
    "train.straggler_margin": _w(LOOP, "straggler_margin"),
    "train.spike_factor": _w(LOOP, "spike rule"), "train.spike_window": _w(LOOP, "spike rule"),
    "train.spike_lr_factor": _w(LOOP, "spike rule"), "train.spike_lr_steps": _w(LOOP, "spike rule"),
    "train.deterministic": _tc("deterministic_mode") + _w(LOOP, "torch.use_deterministic_algorithms"),
    # ---- data
    "data.kind": _w(DATA, "dataset class"), "data.blend": _w(DATA, "blend"), "data.split": _w(DATA, "split"),
    "data.tokenizer": _w(DATA, "tokenizer"), "data.cache_dir": _w(DATA, "path_to_cache"),
    "data.num_workers": _w(DATA, "num_workers"),
    # ---- checkpoint
    "checkpoint.dir": _w(CKPT, "dir"), "checkpoint.save_interval": _w(CKPT, "save_interval"),
    "checkpoint.save_at_end": _w(CKPT, "save_at_end"), "checkpoint.resume": _w(CKPT, "resume"),
    "checkpoint.keep_last": _w(CKPT, "keep_last"), "checkpoint.format": _w(CKPT, "backend"),
    "checkpoint.async_save": _w(CKPT, "async_save"), "checkpoint.load": _w(CKPT, "load"),
    "checkpoint.load_hf": _w(LOGIN),  # import-hf at render (launcher/preflight.py hf_start), then checkpoint.load
    "checkpoint.verify": _w(CKPT, "verify"), "checkpoint.optimizer_format": _w(CKPT, "distrib_optim_sharding_type"),
    # ---- logging
    "logging.log_interval": _w(METRICS, "log_interval"), "logging.tensorboard": _w(METRICS, "SummaryWriter"),
    "logging.wandb_project": _w(METRICS, "wandb.init"), "logging.wandb_entity": _w(METRICS, "wandb.init"),
    "logging.wandb_mode": _w(METRICS, "wandb.init"),
    # ---- cluster
    "cluster.backend": _w(DIST, "backend"),
    "cluster.peak_tflops_bf16": _w(METRICS, "mfu") + _w(LOGIN),
    **{f"cluster.{name}": _w(LOGIN) for name in (
        "name", "launcher", "gpu", "gpus_per_node", "gpu_memory_gb", "peak_tflops_fp8", "hbm_bandwidth_gbps",
        "nvlink_bandwidth_gbps", "network_bandwidth_gbps", "host_bandwidth_gbps", "host_memory_gb", "gemm_efficiency", "fp8_gemm_efficiency",
        "comm_efficiency", "network_efficiency", "memory_reserve_gb", "profile", "partition", "account", "container_image", "container_mounts",
        "workdir", "python", "env", "secret_env", "max_restarts", "checkpoint_write_gbps", "op_overhead_us",
        "compute_units_per_node")},
    "cluster.health_check": _w(DIST, "pre-flight bandwidth probe"),
    # ---- profile (launcher/rank/profiling.py; nsys also wraps the rank command in the bundle's rank.sh)
    **{f"profile.{name}": _w(LOOP, "profiler") for name in (
        "kind", "step_start", "step_end", "ranks", "memory_snapshot", "memory_snapshot_entries")},
    # ---- slurm
    **{f"slurm.{name}": _w(LOGIN) for name in (
        "time", "job_name", "signal_lead_s", "requeue", "exclusive", "extra_args", "max_requeues",
        "signal_save_factor", "signal_margin_s", "on_hang")},
    # ---- timeouts (launcher/core/timeouts.py: resolved at render into env.sh, read by launcher/rank/setup.py)
    "timeouts.collective_s": _w(DIST, "timeout", same=False), "timeouts.heartbeat_s": _w(LOGIN),
    "timeouts.hang_s": _w(LOGIN),  # rendered into env.sh; the node's watchdog (launcher/rank/agent.py) reads it
    # ---- post (no rank reads them: the bundle's post.sh runs launcher/hf/post.py after training)
    **{f"post.{name}": _w(POST) for name in ("export_hf", "eval", "eval_blend", "eval_samples", "lm_eval_tasks")},
}
"""Schema field (dotted path) -> its destinations."""
