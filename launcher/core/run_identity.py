"""Which runs are the same run: the config values a checkpoint records as its run's identity, and its hash.

A run continues only from its own checkpoints (same hash) unless ``checkpoint.load`` names another; the ranks
write both into every manifest (``launcher/core/checkpoint/directory.py`` publish) and name the run that holds a
checkpoint directory's lock by the hash (``launcher/rank/checkpoint/store.py`` DirLock). Torch-free, standard library
only: the tests and tools compute the same identity as the ranks.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict


def _each(section: str, names: str, why: str) -> dict:
    """``{'section.name': why}`` for the space-separated field names of one section ('' for top-level fields)."""
    return {f"{section}.{n}" if section else n: why for n in names.split()}


IDENTITY = {
    **_each("", "nodes", "the world size: data-parallel ranks decide which samples each step holds"),
    **_each("model", "name num_layers hidden_size ffn_hidden_size num_attention_heads num_query_groups kv_channels "
            "vocab_size make_vocab_size_divisible_by seq_length max_position_embeddings normalization norm_epsilon "
            "activation position_embedding rotary_base rotary_percent rope_scaling rope_scaling_factor "
            "tie_embeddings add_bias_linear add_qkv_bias qk_layernorm attention_dropout hidden_dropout "
            "init_method_std num_experts moe_router_topk moe_ffn_hidden_size moe_shared_expert_intermediate_size "
            "moe_layer_freq moe_first_k_dense moe_aux_loss_coeff moe_router_load_balancing_type "
            "moe_router_score_function moe_token_dispatcher_type moe_flex_dispatcher_backend moe_grouped_gemm "
            "moe_router_num_groups moe_router_group_topk moe_router_topk_scaling_factor "
            "moe_router_enable_expert_bias moe_expert_capacity_factor moe_pad_expert_input_to_capacity "
            "multi_latent_attention q_lora_rank kv_lora_rank qk_head_dim qk_pos_emb_head_dim v_head_dim "
            "mtp_num_layers cross_entropy_loss_fusion",
            "the model: its weights (launcher/core/checkpoint/weights.py) and what it computes from them"),
    **_each("parallel", "tensor pipeline virtual_pipeline context expert expert_tensor data sequence_parallel "
            "distributed_optimizer megatron_fsdp overlap_grad_reduce overlap_param_gather tp_comm_overlap "
            "first_stage_layers last_stage_layers account_for_embedding_in_pipeline_split "
            "account_for_loss_in_pipeline_split pipeline_model_parallel_layout moe_a2a_overlap",
            "the layout the checkpoint's shards, optimizer state and RNG streams are saved in (another layout "
            "continues through checkpoint.load, which reshards)"),
    **_each("schedule", "kind microbatch_group_size batch_p2p_comm overlap_p2p_comm zb_v_costs",
            "the order microbatches run in, and so the numerics of a step"),
    **_each("precision", "dtype fp8 fp8_format fp8_param fp8_amax_history_len fp8_amax_compute_algo "
            "transformer_engine grad_reduce_in_fp32 precision_aware_optimizer main_grads_dtype main_params_dtype "
            "exp_avg_dtype exp_avg_sq_dtype", "the numerics, and the dtypes the optimizer state is saved in"),
    **_each("train", "micro_batch_size global_batch_size lr min_lr lr_schedule warmup_steps wsd_decay_steps "
            "weight_decay adam_beta1 adam_beta2 adam_eps clip_grad optimizer_cpu_offload optimizer_offload_fraction "
            "overlap_cpu_optimizer_d2h_h2d seed recompute recompute_num_layers recompute_modules cuda_graph_impl "
            "cuda_graph_modules cuda_graph_warmup_steps activation_offload_modules activation_offload_fraction "
            "min_offloaded_tensor_size",
            "the optimisation the checkpoint's state continues: batches, schedule, optimizer, seeds, recompute"),
    **_each("data", "kind blend split tokenizer", "which tokens, in which order, the run trains on"),
    **_each("cluster", "gpus_per_node backend", "the world size per node and the collectives' backend"),
}
"""The config values that make two runs the same run, each with why; any other field is in ``NOT_IDENTITY``
(tests/test_run_identity.py checks that every schema field is in exactly one)."""

NOT_IDENTITY = {
    **_each("", "name action output_dir force", "where and how the job is launched"),
    **_each("schedule", "record_timeline", "what is recorded about a step, not the step"),
    **_each("train", "train_steps train_tokens exit_after_minutes", "how long it runs: a longer run continues"),
    **_each("train", "eval_interval eval_iters straggler_interval straggler_margin",
            "what is measured and reported along the way"),
    **_each("train", "nonfinite spike_factor spike_window spike_lr_factor spike_lr_steps",
            "policies for bad steps, which a restarted run may change (the skipped batches are in the checkpoint)"),
    **_each("train", "deterministic", "bitwise-reproducible kernels: the same run, reproducibly"),
    **_each("data", "cache_dir num_workers", "where index caches go and how batches are assembled, not which"),
    **_each("checkpoint", "dir save_interval save_at_end resume keep_last format load load_hf verify "
            "optimizer_format async_save", "how and where checkpoints are written and read (resume_rules refuses "
            "what cannot be read)"),
    **_each("logging", "log_interval tensorboard wandb_project wandb_entity wandb_mode", "metrics and logs"),
    **_each("cluster", "name launcher gpu gpu_memory_gb peak_tflops_bf16 peak_tflops_fp8 hbm_bandwidth_gbps "
            "nvlink_bandwidth_gbps network_bandwidth_gbps host_bandwidth_gbps host_memory_gb checkpoint_write_gbps gemm_efficiency fp8_gemm_efficiency "
            "comm_efficiency network_efficiency memory_reserve_gb profile op_overhead_us compute_units_per_node",
            "hardware facts and planner constants: the plan, not the run"),
    **_each("cluster", "partition account container_image container_mounts workdir python max_restarts "
            "health_check env secret_env", "where and how the ranks are started"),
    **_each("slurm", "time job_name signal_lead_s signal_save_factor signal_margin_s requeue max_requeues on_hang "
            "exclusive extra_args", "the Slurm submission, requeues and stops"),
    **_each("profile", "kind step_start step_end ranks memory_snapshot memory_snapshot_entries",
            "what is profiled, not what is trained"),
    **_each("timeouts", "collective_s hang_s heartbeat_s", "how long a wait counts as a hang"),
    **_each("post", "export_hf eval eval_blend eval_samples lm_eval_tasks", "what runs after training ends"),
}
"""Fields that do not change what a checkpoint holds or how training continues from it, each with why: where and
how the job is launched, logged and checkpointed, and how long it runs."""


def run_identity(job) -> dict:
    """The config values that make two runs the same run (flattened 'section.field' -> value): every field but the
    ``NOT_IDENTITY`` ones (a field in neither table counts as identity; the test says to classify it)."""
    flat = {}

    def walk(prefix, value):
        if prefix in NOT_IDENTITY:
            return
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else key, sub)
        else:
            flat[prefix] = value

    walk("", asdict(job))
    return json.loads(json.dumps(flat, default=str))


def run_hash(identity: dict) -> str:
    """The run's name in its checkpoints' manifests and its directory lock (16 hex digits of the identity)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def identity_diff(theirs: dict, ours: dict, limit: int = 3) -> str:
    """The first ``limit`` fields two identities differ in, as ``field=theirs there, ours here`` (error lines)."""
    keys = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    shown = ", ".join(f"{k}={theirs.get(k)!r} there, {ours.get(k)!r} here" for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def model_of(identity: dict):
    """The ``ModelConfig`` a run identity records (a checkpoint's ``launcher.json`` ``identity``): its ``model.*``
    entries that are fields of today's schema. export-hf and its ``--slurm`` bound read a checkpoint's model here."""
    from dataclasses import fields

    from launcher.schema import ModelConfig

    names = {f.name for f in fields(ModelConfig)}
    return ModelConfig(**{k[len("model."):]: v for k, v in identity.items()
                          if k.startswith("model.") and k[len("model."):] in names})
