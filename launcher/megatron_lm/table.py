"""Megatron-LM's argument names for our schema fields: one table, read both ways.

``FLAGS`` lists the ``pretrain_gpt.py`` arguments that set one of our fields on their own (a value, or a switch
that sets the field to one value), each with the value Megatron-LM uses when the argument is absent (in our
terms: what ``megatron/training/arguments.py`` of Megatron-LM 0.19.2 defaults to, after its ``validate_args``).
``COMBINED`` names the arguments that only together determine a field (dtype, FP8, VPP, recompute, LR schedule
lengths, data, checkpoints); ``launcher.megatron_lm.translate`` handles those. ``IGNORED`` are arguments that do
not change what is trained (profiling, logging paths, kernel fusions), with why; ``UNSUPPORTED`` are arguments that
would change the job but have no equivalent here, with why. ``LAUNCHER_ONLY`` names our fields no Megatron-LM
argument sets. ``tests/test_megatron_lm.py`` checks every name here against the parser Megatron-LM itself builds
(when megatron is installed) and that every schema field is in one of these tables, so a new field fails there
until it is mapped or said to be launcher-only.

Login-node code: no torch, no megatron.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Dict, Optional, Sequence

from launcher.core.wiring import BUILT, WIRING
from launcher.fields import hydra_quoted, is_list_field, list_text

ALWAYS = lambda v: True  # noqa: E731
MOE = lambda v: bool(v.get("model.num_experts"))  # noqa: E731
MLA = lambda v: bool(v.get("model.multi_latent_attention"))  # noqa: E731
ROPE = lambda v: v.get("model.position_embedding") == "rope"  # noqa: E731
ROPE_SCALING = lambda v: ROPE(v) and bool(v.get("model.rope_scaling"))  # noqa: E731
DELAYED = lambda v: v.get("precision.fp8") == "delayed"  # noqa: E731
INTERLEAVED = lambda v: (v.get("parallel.virtual_pipeline") or 1) > 1  # noqa: E731
INDEXED = lambda v: v.get("data.kind") == "indexed"  # noqa: E731
GRAPHS = lambda v: v.get("train.cuda_graph_impl", "none") != "none"  # noqa: E731
OFFLOAD = lambda v: bool(v.get("train.activation_offload_modules"))  # noqa: E731
UNREAD = {MOE: "without --num-experts", MLA: "without --multi-latent-attention", ROPE: "without rope positions",
          ROPE_SCALING: "without --use-rope-scaling", DELAYED: "without delayed FP8 scaling",
          INTERLEAVED: "without a virtual pipeline", INDEXED: "with mock data",
          GRAPHS: "without --cuda-graph-impl", OFFLOAD: "without --fine-grained-activation-offloading"}
"""Why an argument given for a job it does not apply to is not read (Megatron-LM does not read it either)."""


def fmt(value: Any) -> str:
    """A value as Megatron-LM's argparse reads it (integral floats as ints: --rotary-base is an int there)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    return str(value)


def override_value(value: Any) -> str:
    """A value as an override of ours types it (Hydra's grammar): a list as [core_attn,mlp] (not Python's
    ['core_attn', 'mlp']), a text Hydra would read otherwise quoted ('949,50,1' is a split, unquoted a sweep)."""
    import re

    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, str) and re.search(r"[\s,\[\]{}()=;'\"\\]", value):
        return hydra_quoted(value)
    return fmt(value)


def typed_override(field: str, value: Any) -> str:
    """``field=value`` as typed on a shell command line: Hydra's grammar inside (override_value), the shell's
    quoting outside where the text needs it ('data.split="949,50,1"')."""
    import re
    import shlex

    text = f"{field}={override_value(value)}"
    return shlex.quote(text) if re.search(r"[\s'\"\\]", text) else text


@dataclass(frozen=True)
class Flag:
    """One Megatron-LM argument that, on its own, sets one of our fields."""

    flag: str
    """The argument as written on the command line, e.g. ``--tensor-model-parallel-size``."""
    field: str
    """Our dotted field, e.g. ``parallel.tensor``."""
    default: Any
    """Megatron-LM's value when the argument is absent (our terms). ``REQUIRED``: it has none."""
    switch: Any = None
    """For a store-true switch: the field's value when given (None: the argument takes a value)."""
    when: Callable[[dict], bool] = ALWAYS
    """Whether the field matters for a job (dotted field -> value); irrelevant fields are neither exported nor
    defaulted on import (e.g. MoE sizes of a dense model)."""
    parse: Optional[Callable[[str], Any]] = None
    """Megatron text -> our value (None: by the field's type)."""
    show: Callable[[Any], str] = fmt
    """Our value -> Megatron text."""


REQUIRED = object()
"""Megatron-LM has no default: the argument must be given (``--num-layers``, ``--hidden-size``, ...)."""


def _impl(text: str) -> str:
    return {"transformer_engine": "true", "local": "false"}.get(text, f"<{text}>")


def _impl_show(value: str) -> str:
    return {"true": "transformer_engine", "false": "local"}[value]


FLAGS: tuple[Flag, ...] = (
    # ---- model size (REQUIRED ones are always exported)
    Flag("--num-layers", "model.num_layers", REQUIRED),
    Flag("--hidden-size", "model.hidden_size", REQUIRED),
    Flag("--num-attention-heads", "model.num_attention_heads", REQUIRED),
    Flag("--kv-channels", "model.kv_channels", None),
    Flag("--seq-length", "model.seq_length", REQUIRED),
    Flag("--make-vocab-size-divisible-by", "model.make_vocab_size_divisible_by", 128),
    Flag("--normalization", "model.normalization", "LayerNorm"),
    Flag("--norm-epsilon", "model.norm_epsilon", 1e-5),
    Flag("--rotary-base", "model.rotary_base", 10000.0, when=ROPE),
    Flag("--rotary-percent", "model.rotary_percent", 1.0, when=ROPE),
    Flag("--use-rope-scaling", "model.rope_scaling", False, switch=True, when=ROPE),
    Flag("--rope-scaling-factor", "model.rope_scaling_factor", 8.0, when=ROPE_SCALING),
    Flag("--untie-embeddings-and-output-weights", "model.tie_embeddings", True, switch=False),
    Flag("--disable-bias-linear", "model.add_bias_linear", True, switch=False),
    Flag("--add-qkv-bias", "model.add_qkv_bias", False, switch=True),
    Flag("--qk-layernorm", "model.qk_layernorm", False, switch=True),
    Flag("--attention-dropout", "model.attention_dropout", 0.1),
    Flag("--hidden-dropout", "model.hidden_dropout", 0.1),
    Flag("--init-method-std", "model.init_method_std", 0.02),
    # ---- MoE
    Flag("--num-experts", "model.num_experts", None),
    Flag("--moe-router-topk", "model.moe_router_topk", 2, when=MOE),
    Flag("--moe-shared-expert-intermediate-size", "model.moe_shared_expert_intermediate_size", None, when=MOE),
    Flag("--moe-router-score-function", "model.moe_router_score_function", "softmax", when=MOE),
    Flag("--moe-router-num-groups", "model.moe_router_num_groups", None, when=MOE),
    Flag("--moe-router-group-topk", "model.moe_router_group_topk", None, when=MOE),
    Flag("--moe-router-enable-expert-bias", "model.moe_router_enable_expert_bias", False, switch=True, when=MOE),
    Flag("--moe-router-topk-scaling-factor", "model.moe_router_topk_scaling_factor", None, when=MOE),
    Flag("--moe-token-dispatcher-type", "model.moe_token_dispatcher_type", "allgather", when=MOE),
    Flag("--moe-flex-dispatcher-backend", "model.moe_flex_dispatcher_backend", "deepep", when=MOE),
    Flag("--moe-expert-capacity-factor", "model.moe_expert_capacity_factor", None, when=MOE),
    Flag("--moe-pad-expert-input-to-capacity", "model.moe_pad_expert_input_to_capacity", False, switch=True,
         when=MOE),
    Flag("--moe-grouped-gemm", "model.moe_grouped_gemm", False, switch=True, when=MOE),
    # ---- multi-latent attention, multi-token prediction
    Flag("--multi-latent-attention", "model.multi_latent_attention", False, switch=True),
    Flag("--q-lora-rank", "model.q_lora_rank", None, when=MLA),
    Flag("--kv-lora-rank", "model.kv_lora_rank", 32, when=MLA),
    Flag("--qk-head-dim", "model.qk_head_dim", 128, when=MLA),
    Flag("--qk-pos-emb-head-dim", "model.qk_pos_emb_head_dim", 64, when=MLA),
    Flag("--v-head-dim", "model.v_head_dim", 128, when=MLA),
    Flag("--mtp-num-layers", "model.mtp_num_layers", 0),
    # ---- parallel layout
    Flag("--tensor-model-parallel-size", "parallel.tensor", 1),
    Flag("--pipeline-model-parallel-size", "parallel.pipeline", 1),
    Flag("--context-parallel-size", "parallel.context", 1),
    Flag("--expert-model-parallel-size", "parallel.expert", 1),
    Flag("--expert-tensor-parallel-size", "parallel.expert_tensor", None),
    Flag("--sequence-parallel", "parallel.sequence_parallel", False, switch=True),
    Flag("--use-distributed-optimizer", "parallel.distributed_optimizer", False, switch=True),
    Flag("--use-megatron-fsdp", "parallel.megatron_fsdp", False, switch=True),
    Flag("--overlap-grad-reduce", "parallel.overlap_grad_reduce", False, switch=True),
    Flag("--overlap-param-gather", "parallel.overlap_param_gather", False, switch=True),
    Flag("--tp-comm-overlap", "parallel.tp_comm_overlap", False, switch=True),
    Flag("--decoder-first-pipeline-num-layers", "parallel.first_stage_layers", None),
    Flag("--decoder-last-pipeline-num-layers", "parallel.last_stage_layers", None),
    Flag("--account-for-embedding-in-pipeline-split", "parallel.account_for_embedding_in_pipeline_split", False,
         switch=True),
    Flag("--account-for-loss-in-pipeline-split", "parallel.account_for_loss_in_pipeline_split", False,
         switch=True),
    Flag("--overlap-moe-expert-parallel-comm", "parallel.moe_a2a_overlap", False, switch=True, when=MOE),
    Flag("--cross-entropy-loss-fusion", "model.cross_entropy_loss_fusion", False, switch=True),
    Flag("--microbatch-group-size-per-virtual-pipeline-stage", "schedule.microbatch_group_size", None,
         when=INTERLEAVED),
    # ---- precision
    Flag("--fp8-param-gather", "precision.fp8_param", False, switch=True),
    Flag("--fp8-amax-history-len", "precision.fp8_amax_history_len", 1, when=DELAYED),
    Flag("--fp8-amax-compute-algo", "precision.fp8_amax_compute_algo", "most_recent", when=DELAYED),
    Flag("--transformer-impl", "precision.transformer_engine", "auto", parse=_impl, show=_impl_show),
    Flag("--use-precision-aware-optimizer", "precision.precision_aware_optimizer", False, switch=True),
    Flag("--main-grads-dtype", "precision.main_grads_dtype", "fp32"),
    Flag("--main-params-dtype", "precision.main_params_dtype", "fp32"),
    Flag("--exp-avg-dtype", "precision.exp_avg_dtype", "fp32"),
    Flag("--exp-avg-sq-dtype", "precision.exp_avg_sq_dtype", "fp32"),
    # ---- training
    Flag("--micro-batch-size", "train.micro_batch_size", REQUIRED),
    Flag("--lr", "train.lr", REQUIRED),
    Flag("--min-lr", "train.min_lr", 0.0),
    Flag("--weight-decay", "train.weight_decay", 0.01),
    Flag("--adam-beta1", "train.adam_beta1", 0.9),
    Flag("--adam-beta2", "train.adam_beta2", 0.999),
    Flag("--adam-eps", "train.adam_eps", 1e-8),
    Flag("--clip-grad", "train.clip_grad", 1.0),
    Flag("--seed", "train.seed", 1234),
    Flag("--eval-interval", "train.eval_interval", 0),
    Flag("--eval-iters", "train.eval_iters", 100),
    Flag("--exit-duration-in-mins", "train.exit_after_minutes", None),
    Flag("--deterministic-mode", "train.deterministic", False, switch=True),
    Flag("--optimizer-cpu-offload", "train.optimizer_cpu_offload", False, switch=True),
    Flag("--optimizer-offload-fraction", "train.optimizer_offload_fraction", 1.0),
    Flag("--overlap-cpu-optimizer-d2h-h2d", "train.overlap_cpu_optimizer_d2h_h2d", False, switch=True),
    Flag("--cuda-graph-impl", "train.cuda_graph_impl", "none"),
    Flag("--cuda-graph-warmup-steps", "train.cuda_graph_warmup_steps", 3, when=GRAPHS),
    Flag("--activation-offload-fraction", "train.activation_offload_fraction", 1.0, when=OFFLOAD),
    Flag("--min-offloaded-tensor-size", "train.min_offloaded_tensor_size", 1048576, when=OFFLOAD),
    # ---- data, checkpoints, logging, cluster
    Flag("--split", "data.split", "969,30,1", when=INDEXED, parse=lambda t: t.replace(" ", "")),
    Flag("--data-cache-path", "data.cache_dir", None),
    Flag("--num-workers", "data.num_workers", 2),
    Flag("--save-interval", "checkpoint.save_interval", 0),
    # fsdp_dtensor is what Megatron-LM requires with --use-megatron-fsdp (which says FSDP on its own; the export
    # writes it back from parallel.megatron_fsdp): read as our one format, whose ranks refuse FSDP runs
    Flag("--ckpt-format", "checkpoint.format", "torch_dist", parse=lambda t: "torch_dist" if t == "fsdp_dtensor" else t),
    Flag("--async-save", "checkpoint.async_save", False, switch=True),
    Flag("--dist-ckpt-optim-fully-reshardable", "checkpoint.optimizer_format", "dp_reshardable",
         switch="fully_reshardable"),
    Flag("--log-interval", "logging.log_interval", 100),
    Flag("--wandb-project", "logging.wandb_project", None),
    Flag("--wandb-entity", "logging.wandb_entity", None),
    Flag("--wandb-exp-name", "name", None),
    Flag("--distributed-backend", "cluster.backend", "nccl"),
)
"""Arguments that set one field each (``FLAG_BY_NAME`` indexes them)."""


def _exists(dotted: str) -> bool:
    from launcher.schema import SECTIONS, JobConfig
    section, _, name = dotted.rpartition(".")
    return name in (SECTIONS[section] if section else JobConfig).__dataclass_fields__


FLAGS = tuple(f for f in FLAGS if _exists(f.field))  # a field another branch has not added yet: not mapped
FLAG_BY_NAME: Dict[str, Flag] = {f.flag: f for f in FLAGS}


COMBINED: Dict[str, str] = {
    # flag -> the field(s) it decides together with others (see launcher.megatron_lm.translate)
    "--ffn-hidden-size": "model.ffn_hidden_size",
    "--group-query-attention": "model.num_query_groups",
    "--num-query-groups": "model.num_query_groups",
    "--vocab-size": "model.vocab_size",
    "--max-position-embeddings": "model.max_position_embeddings",
    "--swiglu": "model.activation",
    "--squared-relu": "model.activation",
    "--position-embedding-type": "model.position_embedding",
    "--use-rotary-position-embeddings": "model.position_embedding",
    "--no-position-embedding": "model.position_embedding",
    "--moe-ffn-hidden-size": "model.moe_ffn_hidden_size",
    "--moe-layer-freq": "model.moe_layer_freq, model.moe_first_k_dense",
    "--moe-aux-loss-coeff": "model.moe_aux_loss_coeff",
    "--moe-router-load-balancing-type": "model.moe_router_load_balancing_type",
    "--num-layers-per-virtual-pipeline-stage": "parallel.virtual_pipeline, schedule.kind",
    "--num-virtual-stages-per-pipeline-rank": "parallel.virtual_pipeline, schedule.kind",
    "--pipeline-model-parallel-layout": "parallel.pipeline_model_parallel_layout, parallel.virtual_pipeline",
    "--no-overlap-p2p-communication": "schedule.overlap_p2p_comm",
    "--data-parallel-sharding-strategy": "parallel.megatron_fsdp",
    "--bf16": "precision.dtype",
    "--fp16": "precision.dtype",
    "--fp8-format": "precision.fp8, precision.fp8_format",
    "--fp8-recipe": "precision.fp8",
    "--grad-reduce-in-bf16": "precision.grad_reduce_in_fp32",
    "--accumulate-allreduce-grads-in-fp32": "precision.grad_reduce_in_fp32",
    "--global-batch-size": "train.global_batch_size",
    "--train-iters": "train.train_steps",
    "--train-samples": "train.train_steps",
    "--lr-decay-iters": "train.train_steps",
    "--lr-decay-samples": "train.train_steps",
    "--lr-decay-style": "train.lr_schedule",
    "--lr-warmup-iters": "train.warmup_steps",
    "--lr-warmup-samples": "train.warmup_steps",
    "--lr-warmup-fraction": "train.warmup_steps",
    "--lr-wsd-decay-iters": "train.wsd_decay_steps",
    "--lr-wsd-decay-samples": "train.wsd_decay_steps",
    "--lr-wsd-decay-style": "train.lr_schedule",
    "--recompute-granularity": "train.recompute",
    "--recompute-method": "train.recompute",
    "--recompute-num-layers": "train.recompute_num_layers",
    "--recompute-activations": "train.recompute",
    "--recompute-modules": "train.recompute_modules",
    "--cuda-graph-modules": "train.cuda_graph_modules",
    "--cuda-graph-scope": "train.cuda_graph_modules",  # its deprecated name (hidden in Megatron-LM's parser)
    "--fine-grained-activation-offloading": "train.activation_offload_modules",  # on with a non-empty list
    "--offload-modules": "train.activation_offload_modules",
    "--data-path": "data.blend, data.kind",
    "--mock-data": "data.kind",
    "--tokenizer-type": "data.tokenizer",
    "--tokenizer-model": "data.tokenizer",
    "--save": "checkpoint.dir",
    "--load": "checkpoint.dir, checkpoint.resume, checkpoint.load",
    "--tensorboard-dir": "logging.tensorboard",
}
"""Arguments that decide a field only together with others."""

IGNORED: Dict[str, str] = {
    "--use-mcore-models": "Megatron-Core models are the only kind here",
    "--attention-backend": "Transformer Engine picks its fused attention kernel",
    "--use-flash-attn": "Transformer Engine picks its fused attention kernel",
    "--no-masked-softmax-fusion": "a kernel-fusion choice; the result is the same",
    "--no-bias-dropout-fusion": "a kernel-fusion choice; the result is the same",
    "--no-bias-gelu-fusion": "a kernel-fusion choice; the result is the same",
    "--no-bias-swiglu-fusion": "a kernel-fusion choice; the result is the same",
    "--no-rope-fusion": "a kernel-fusion choice; the result is the same",
    "--no-gradient-accumulation-fusion": "a kernel-fusion choice; the result is the same",
    "--cross-entropy-loss-fusion": "a kernel-fusion choice; the result is the same",
    "--moe-permute-fusion": "a kernel-fusion choice; the result is the same",
    "--manual-gc": "Python garbage-collector tuning",
    "--manual-gc-interval": "Python garbage-collector tuning",
    "--empty-unused-memory-level": "CUDA cache emptying; no effect on what is trained",
    "--log-throughput": "profiling/logging: the launcher always logs tokens/s and TFLOP/s",
    "--log-timers-to-tensorboard": "profiling/logging",
    "--log-memory-to-tensorboard": "profiling/logging",
    "--log-validation-ppl-to-tensorboard": "profiling/logging",
    "--log-params-norm": "profiling/logging",
    "--log-num-zeros-in-grad": "profiling/logging",
    "--log-world-size-to-tensorboard": "profiling/logging",
    "--tensorboard-queue-size": "profiling/logging",
    "--tensorboard-log-interval": "profiling/logging: TensorBoard follows logging.log_interval",
    "--timing-log-level": "profiling/logging",
    "--timing-log-option": "profiling/logging",
    "--profile": "profiling (profile.kind=nsys here; not part of the job)",
    "--use-pytorch-profiler": "profiling (profile.kind=torch here; not part of the job)",
    "--profile-step-start": "profiling (profile.step_start here; not part of the job)",
    "--profile-step-end": "profiling (profile.step_end here; not part of the job)",
    "--profile-ranks": "profiling (profile.ranks here; not part of the job)",
    "--record-memory-history": "profiling (profile.memory_snapshot here; not part of the job)",
    "--memory-snapshot-path": "profiling: the snapshot goes into the run bundle's profile/ folder",
    "--wandb-save-dir": "logging path: wandb files go into the run bundle",
    "--distributed-timeout-minutes": "only how long a hung collective waits before failing",
    "--no-create-attention-mask-in-dataloader": "no mask is built: attention is causal in the kernel",
    "--no-mmap-bin-files": "how the .bin files are read, not what is read",
    "--num-dataset-builder-threads": "how dataset indices are built, not what they contain",
    "--ckpt-fully-parallel-save": "checkpoint I/O strategy (dist_checkpointing decides)",
    "--ckpt-fully-parallel-load": "checkpoint I/O strategy (dist_checkpointing decides)",
    "--dist-ckpt-strictness": "checkpoint loading strictness",
    "--use-checkpoint-opt_param-scheduler": "the LR schedule always resumes from the checkpoint",
    "--exit-signal-handler": "SIGUSR1 checkpoint-and-exit is always on under Slurm (slurm.signal_lead_s)",
    "--optimizer": "AdamW (Megatron-LM's 'adam' with decoupled weight decay) is the only optimizer here",
    "--attention-softmax-in-fp32": "the attention softmax is always in fp32 here (Megatron-Core's default)",
    "--tiktoken-pattern": "tokenizer detail of Megatron-LM's tiktoken tokenizer; mock data has none",
}
"""Arguments accepted without effect on the job, with why."""

UNSUPPORTED: Dict[str, str] = {
    "--cpu-offloading-num-layers": "Megatron-Core's layer-level CPU offloading (TE's offload context, no pipeline "
                                   "parallelism) is not built; train.activation_offload_modules is the fine-grained one",
    "--delay-offload-until-cuda-graph": "the offload manager's tuning is left at Megatron-Core's default",
    "--delta-offload-bytes-across-pp-ranks": "the offload manager's tuning is left at Megatron-Core's default",
    "--fine-grained-offloading-max-inflight-offloads": "the offload manager's tuning is left at Megatron-Core's "
                                                       "default (needed only with full-iteration CUDA graphs)",
    "--apply-layernorm-1p": "zero-centred LayerNorm gamma is not in the schema",
    "--openai-gelu": "only swiglu, gelu and squared_relu activations (model.activation)",
    "--quick-geglu": "only swiglu, gelu and squared_relu activations (model.activation)",
    "--decoupled-lr": "one learning rate for all parameters (train.lr)",
    "--decoupled-min-lr": "one learning rate for all parameters (train.min_lr)",
    "--calculate-per-token-loss": "the loss is averaged per microbatch, as Megatron-LM's default",
    "--rampup-batch-size": "the global batch is constant (train.global_batch_size)",
    "--step-batch-size-schedule": "the global batch is constant (train.global_batch_size)",
    "--no-load-optim": "a run resumes its full state (checkpoint.resume)",
    "--no-load-rng": "a run resumes its full state (checkpoint.resume)",
    "--no-save-optim": "checkpoints always hold the optimizer state",
    "--no-save-rng": "checkpoints always hold the RNG state",
    "--finetune": "start from another checkpoint with checkpoint.load=DIR (weights and optimizer state)",
    "--pretrained-checkpoint": "start from another checkpoint with checkpoint.load=DIR",
    "--exit-interval": "stop by time (train.exit_after_minutes) or at the end of train.train_steps",
    "--vocab-file": "tokenizers are Hugging Face tokenizer.json files (data.tokenizer); convert the GPT-2 "
                    "vocab/merges to one",
    "--merge-file": "tokenizers are Hugging Face tokenizer.json files (data.tokenizer); convert the GPT-2 "
                    "vocab/merges to one",
    "--moe-router-dtype": "the router runs in the model dtype",
    "--moe-z-loss-coeff": "no router z-loss",
    "--moe-router-enable-expert-bias": "no aux-loss-free expert bias",
    "--moe-router-topk-scaling-factor": "no routed-score scaling",
    "--moe-router-num-groups": "no group-limited routing",
    "--moe-router-group-topk": "no group-limited routing",
    "--moe-expert-capacity-factor": "dropless MoE only",
    "--rotary-seq-len-interpolation-factor": "only Llama-3.1 RoPE scaling (model.rope_scaling)",
    "--use-torch-fsdp2": "data parallelism is Megatron DDP with the distributed optimizer",
    "--use-megatron-fsdp": "data parallelism is Megatron DDP with the distributed optimizer",
    "--start-weight-decay": "constant weight decay (train.weight_decay)",
    "--end-weight-decay": "constant weight decay (train.weight_decay)",
    "--weight-decay-incr-style": "constant weight decay (train.weight_decay)",
    "--overlap-moe-expert-parallel-comm": "no MoE all-to-all overlap schedule",
    "--delay-wgrad-compute": "weight-gradient deferral belongs to schedule.kind=zb_h1 here",
    "--moe-layer-recompute": "selective recompute covers core attention only",
}
"""Arguments that would change the job but have no equivalent here, with why."""

for _f in FLAGS:  # a mapped argument is neither ignored nor unsupported
    IGNORED.pop(_f.flag, None)
    UNSUPPORTED.pop(_f.flag, None)

LAUNCHER_ONLY: Dict[str, str] = {
    "action": "what the launcher does with the job", "output_dir": "where run bundles go",
    "force": "a launcher switch", "model.name": "a label of the model entry",
    "parallel.data": "an assertion on the derived data-parallel size",
    "schedule.batch_p2p_comm": "Megatron-LM batches p2p exactly when it does not overlap it",
    "schedule.record_timeline": "a launcher diagnostic",
    "timeouts.collective_s": "derived per job at render from the plan (launcher/core/timeouts.py) and exported in "
                             "env.sh; Megatron-LM's --distributed-timeout-minutes is a fixed 10 unless given",
    "timeouts.heartbeat_s": "an environment variable of the bundle (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC)",
    "timeouts.hang_s": "the launcher's own per-node hang watchdog",
    "schedule.zb_v_costs": "the op order of schedule.kind=zb_v, a launcher schedule (exported as interleaved)",
    "train.train_tokens": "exported as its number of steps (--train-iters)",
    "train.nonfinite": "Megatron-LM stops on a NaN/Inf loss or gradient (--check-for-nan-in-loss-and-grad), "
                       "as nonfinite=stop",
    "train.straggler_interval": "a launcher diagnostic", "train.straggler_margin": "a launcher diagnostic",
    **{f"train.{n}": "the launcher's loss-spike rollback and replay (Megatron-LM re-runs one step at most: "
                     "--rerun-mode)" for n in ("spike_factor", "spike_window", "spike_lr_factor", "spike_lr_steps")},
    "checkpoint.save_at_end": "Megatron-LM saves at the end whenever --save is given",
    "checkpoint.keep_last": "Megatron-LM keeps every checkpoint",
    "checkpoint.verify": "launcher checkpoint hygiene (manifest sizes / checksums)",
    "checkpoint.load_hf": "Megatron-LM reads no Hugging Face weights (Megatron-Bridge converts them); here render "
                          "imports them with import-hf and checkpoint.load (--load) names the import",
    "logging.wandb_mode": "the WANDB_MODE environment variable (exported with the arguments)",
    "cluster.profile": "the planner's calibrated constants (action=bench), read on the login node only",
    **{f"profile.{name}": "profiling: how a run is observed, not what it trains (Megatron-LM's --profile* and "
                          "--record-memory-history are read as ignored)"
       for name in ("kind", "step_start", "step_end", "ranks", "memory_snapshot", "memory_snapshot_entries")},
    **{f"post.{name}": "a step after training (export to Hugging Face, evaluation), not part of the job"
       for name in ("export_hf", "eval", "eval_blend", "eval_samples", "lm_eval_tasks")},
}
"""Fields no Megatron-LM argument sets (besides cluster.* and slurm.*, the site profile), with why. Export
names those that differ from the schema's default as not expressible; import keeps the recipe's value."""

CLI_POINTERS: Dict[str, str] = {
    "--dry-run": "action=render",
    "--dryrun": "action=render",
    "--plan": "action=plan",
    "--validate": "action=validate",
    "--submit": "action=submit",
    "--search": "action=search",
    "--local": "cluster=local action=run",
    "--print-config": "--cfg job",
    "--config-name": "recipe=NAME",
    "-cn": "recipe=NAME",
    "--config-path": "recipe=NAME (recipes live in recipes/recipe/)",
    "--config-file": "recipe=NAME (recipes live in recipes/recipe/)",
    "--yaml-config": "recipe=NAME, or import a Megatron-LM job: python -m launcher import SCRIPT",
    "--nodes": "nodes=N",
    "--nnodes": "nodes=N",
    "--gpus-per-node": "cluster.gpus_per_node=N",
    "--nproc-per-node": "cluster.gpus_per_node=N",
    "--nproc_per_node": "cluster.gpus_per_node=N",
    "--output": "output_dir=DIR",
    "--output-dir": "output_dir=DIR",
    "--partition": "cluster.partition=NAME",
    "--account": "cluster.account=NAME",
    "--time": "slurm.time=HH:MM:SS",
}
"""Flags of neighbouring launchers (NeMo-Run, Hydra apps, torchrun, sbatch) -> what to type here."""

VALUE_NEEDED = "VALUE"


def _norm(name: str) -> str:
    return name.lstrip("-").replace("-", "_")


@lru_cache(maxsize=None)
def _core_names() -> Dict[str, str]:
    """Megatron-Core config attribute -> our field, from the wiring table (only unambiguous ones)."""
    seen: Dict[str, set] = {}
    for name, wires in WIRING.items():
        for w in wires:
            if w.target in BUILT and w.attr and w.same:
                seen.setdefault(w.attr, set()).add(name)
    return {attr: next(iter(fields)) for attr, fields in seen.items() if len(fields) == 1}


_ARG_DESTS = {  # argparse dests that differ from the flag's spelling
    "layernorm_epsilon": "--norm-epsilon", "add_position_embedding": "--no-position-embedding",
    "fp8": "--fp8-format", "num_moe_experts": "--num-experts", "train_iters": "--train-iters",
    "num_layers_in_first_pipeline_stage": "--decoder-first-pipeline-num-layers",
    "num_layers_in_last_pipeline_stage": "--decoder-last-pipeline-num-layers",
    "fp8_param_gather": "--fp8-param-gather", "fp8_param": "--fp8-param-gather",
    "overlap_p2p_comm": "--no-overlap-p2p-communication", "untie_embeddings_and_output_weights":
        "--untie-embeddings-and-output-weights", "add_bias_linear": "--disable-bias-linear",
    "recompute_granularity": "--recompute-granularity",
    "lr_decay_style": "--lr-decay-style", "lr_warmup_iters": "--lr-warmup-iters",
    "transformer_impl": "--transformer-impl", "use_rope_scaling": "--use-rope-scaling",
}


def hint_for(name: str, value: Optional[str], more: Sequence[str] = ()) -> Optional[str]:
    """For a Megatron-LM argument or Megatron-Core config name, the override to type here, as a message;
    None when ``name`` is neither. ``value`` is what the user typed (None: nothing, e.g. a bare ``--bf16``);
    ``more``, the command-line words after it (a list field's items, as Megatron's nargs='+' takes them)."""
    key = _norm(name)
    flag = "--" + key.replace("_", "-")
    if flag in IGNORED and flag not in FLAG_BY_NAME:
        return f"{name} is a Megatron-LM argument with no effect here ({IGNORED[flag]}); drop it"
    if flag in UNSUPPORTED and flag not in FLAG_BY_NAME:
        return f"{name} is a Megatron-LM argument with no equivalent here: {UNSUPPORTED[flag]}; try --help"
    target = _target(flag, key, value)
    if target is not None and more and is_list_field(target[0]):
        target = _target(flag, key, " ".join([value or "", *more]))  # Megatron's nargs='+': the words are the list
    if target is None:
        return None
    field, override = _as_list(*target)
    if field.rpartition(".")[2] == key:
        return f"{name} is {field} here; try {override}"
    return f"{name} is Megatron's name for {field}; try {override}"


def _target(flag: str, key: str, value: Optional[str]) -> Optional[tuple[str, str]]:
    """(our field, the override to type): the argument itself; else a Megatron-Core config attribute (its value
    means what ours means); else an argparse dest spelled differently from its flag (--norm-epsilon's
    layernorm_epsilon)."""
    target = _flag_override(flag, value)
    core = _core_names().get(key) or {"params_dtype": "precision.dtype"}.get(key)
    if target is None and core is not None:
        target = (core, f"{core}={value or VALUE_NEEDED}" if value in (None, "") or is_list_field(core)
                  else typed_override(core, value))
    if target is None and key in _ARG_DESTS:
        target = _flag_override(_ARG_DESTS[key], value)
    return target


def _as_list(field: str, override: str) -> tuple[str, str]:
    """A list field's override with the value typed as Megatron takes it (``--recompute-modules core_attn mlp``,
    ``cuda_graph_scope=attn``) written as our list, ``[core_attn,mlp]``: a bare value is not a list here."""
    name, sep, value = override.partition("=")
    if name != field or not sep or not is_list_field(field) or value == VALUE_NEEDED or value[:1] in ("[", "'", '"'):
        return field, override
    return field, f"{field}={list_text(value)}"


def _flag_override(flag: str, value: Optional[str]) -> Optional[tuple[str, str]]:
    """(our field, the override to type) for a Megatron-LM flag and the value typed with it."""
    shown = value if value not in (None, "") else None
    on = shown is None or shown.lower() in ("true", "1", "yes")
    if flag in FLAG_BY_NAME:
        f = FLAG_BY_NAME[flag]
        if f.switch is not None:
            val = f.switch if on else (not f.switch if isinstance(f.switch, bool) else f.default)
            return f.field, typed_override(f.field, val)
        if shown is None or (f.parse is None and is_list_field(f.field)):  # words of a list: _as_list
            return f.field, f"{f.field}={shown or VALUE_NEEDED}"
        return f.field, typed_override(f.field, f.parse(shown) if f.parse is not None else shown)
    special = {
        "--bf16": ("precision.dtype", "precision.dtype=bf16"),
        "--fp16": ("precision.dtype", "precision.dtype=fp16"),
        "--swiglu": ("model.activation", "model.activation=swiglu"),
        "--squared-relu": ("model.activation", "model.activation=squared_relu"),
        "--mock-data": ("data.kind", "data.kind=mock"),
        "--recompute-activations": ("train.recompute", "train.recompute=selective"),
        "--grad-reduce-in-bf16": ("precision.grad_reduce_in_fp32", "precision.grad_reduce_in_fp32=false"),
        "--accumulate-allreduce-grads-in-fp32": ("precision.grad_reduce_in_fp32",
                                                 "precision.grad_reduce_in_fp32=true"),
        "--no-overlap-p2p-communication": ("schedule.overlap_p2p_comm", "schedule.overlap_p2p_comm=false"),
        "--group-query-attention": ("model.num_query_groups", "model.num_query_groups=N"),
        "--fp8-format": ("precision.fp8_format", f"precision.fp8=delayed precision.fp8_format={shown or 'hybrid'}"),
        "--fp8-recipe": ("precision.fp8", f"precision.fp8={shown or 'delayed'}"),
        "--lr-decay-style": ("train.lr_schedule", f"train.lr_schedule={(shown or 'cosine').lower()}"),
        "--num-virtual-stages-per-pipeline-rank": (
            "parallel.virtual_pipeline",
            f"parallel.virtual_pipeline={shown or VALUE_NEEDED} schedule.kind=interleaved"),
        "--num-layers-per-virtual-pipeline-stage": (
            "parallel.virtual_pipeline",
            f"parallel.virtual_pipeline=<layers per stage / {shown or 'N'}> schedule.kind=interleaved"),
        "--train-samples": ("train.train_steps", "train.train_steps=SAMPLES/GLOBAL_BATCH"),
        "--data-path": ("data.blend", f"data.kind=indexed 'data.blend=[{(shown or 'PREFIX').replace(' ', ',')}]'"),
        "--tokenizer-model": ("data.tokenizer", f"data.tokenizer={shown or 'PATH/tokenizer.json'}"),
        "--save": ("checkpoint.dir", f"checkpoint.dir={shown or 'DIR'}"),
        "--load": ("checkpoint.dir", f"checkpoint.dir={shown or 'DIR'}"),
        "--tensorboard-dir": ("logging.tensorboard", "logging.tensorboard=true"),
        # the switch alone names no module: the attention input every TE layer has (validate_activation_offload)
        "--fine-grained-activation-offloading": ("train.activation_offload_modules",
                                                 "train.activation_offload_modules=[qkv_linear]"),
        "--moe-layer-freq": ("model.moe_layer_freq", f"model.moe_layer_freq={shown or 'N'} (model.moe_first_k_dense=K "
                                                     "for a leading dense block)"),
    }
    if flag in special:
        return special[flag]
    if flag in COMBINED:
        field = COMBINED[flag].split(",")[0]
        return field, f"{field}={shown or VALUE_NEEDED}"
    return None


def cli_flag_hint(token: str, value: Optional[str], more: Sequence[str] = ()) -> Optional[str]:
    """A one-line answer for a ``--flag`` given to ``python -m launcher``: a neighbour's flag or Megatron's."""
    flag = token.split("=", 1)[0]
    if "=" in token:
        value = token.split("=", 1)[1]
    if flag in CLI_POINTERS:
        return f"{flag} is not a flag here; try {CLI_POINTERS[flag]}"
    return hint_for(flag, value, more)
