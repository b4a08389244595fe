"""Cross-field rules of the model, precision and train sections (architecture, RoPE, MoE routing; FP8 and the
dtype against the cluster; batch, schedule length, optimizer and recompute): TransformerConfig.__post_init__,
the layer modules of megatron/core/transformer and Megatron-LM's arguments.py are the upstream checks mirrored.
Login-node code.
"""
from __future__ import annotations

from launcher.core import Layout
from launcher.fields import is_allowed
from launcher.problems import Problem
from launcher.schema import ACTIVATION_OFFLOAD_MODULES, CUDA_GRAPH_MODULES, JobConfig, ModelConfig, Recompute, Schedule
from launcher.validate.generic import Checks, divisor_near, in_bounds, respelled_list, round_up


HOPPER_OR_NEWER = ("H100", "H200", "GH200", "B200", "GB200")

BLACKWELL = ("B200", "GB200")
HOPPER = ("H100", "H200", "GH200")
"""Where Transformer Engine 2.7 (NGC 25.09) runs FP8 blockwise scaling: ``check_fp8_block_scaling_support`` requires
compute capability 9.x ("FP8 block scaled GEMM requires Hopper and CUDA >= 12.9")."""


def validate_model(model: ModelConfig) -> list[Problem]:
    """Architecture rules (ranges are in ``BOUNDS``); TransformerConfig.__post_init__ and the layer modules
    of megatron/core/transformer are the upstream checks mirrored here."""
    c = Checks()
    heads = model.num_attention_heads if model.num_attention_heads >= 1 else 1
    if model.kv_channels is None and not model.multi_latent_attention and model.hidden_size >= 1:
        # transformer_config.py: kv_channels = hidden_size // num_attention_heads
        c.need(model.hidden_size % heads == 0, "model.num_attention_heads", model.num_attention_heads,
               f"must divide model.hidden_size={model.hidden_size} (or set model.kv_channels)",
               f"model.num_attention_heads={divisor_near(model.hidden_size, heads)}")
    if model.num_query_groups is not None and model.num_query_groups >= 1:
        c.need(heads % model.num_query_groups == 0, "model.num_query_groups", model.num_query_groups,
               f"must divide model.num_attention_heads={heads}", f"model.num_query_groups={divisor_near(heads, 8)}")
    max_pos = model.max_position_embeddings
    if max_pos is not None and max_pos >= 1:
        # Megatron-LM arguments.py: "max_position_embeddings >= seq_length"
        c.need(model.seq_length <= max_pos, "model.seq_length", model.seq_length,
               f"must not exceed model.max_position_embeddings={max_pos}", f"model.seq_length={max_pos}")
    _validate_rope(c, model, heads)
    if model.mtp_num_layers:
        # Megatron-LM arguments.py ("MTP validation"): MTP supports rope and none position embeddings only
        c.need(model.position_embedding in ("rope", "none"), "model.position_embedding", model.position_embedding,
               "multi-token prediction (model.mtp_num_layers > 0) works with rope or none positions only "
               "(Megatron-LM)", "model.position_embedding=rope")
    if model.num_experts is not None and model.num_experts >= 1:
        _validate_moe(c, model)
    if model.multi_latent_attention:
        c.need(model.position_embedding == "rope", "model.position_embedding", model.position_embedding,
               "multi-latent attention uses decoupled RoPE", "model.position_embedding=rope")
        # Megatron-LM arguments.py: "Group query attention is mutually exclusive with multi latent attention."
        c.need(model.num_query_groups is None, "model.num_query_groups", model.num_query_groups,
               "grouped-query attention is mutually exclusive with multi-latent attention", "model.num_query_groups=null")
    return c.problems


def _validate_rope(c: Checks, model: ModelConfig, heads: int) -> None:
    """models/common/embeddings/rotary_pos_embedding.py: RoPE rotates int(head dim x rotary_percent) dimensions
    in pairs (inv_freq over arange(0, dim, 2), then duplicated), so that count must be even and at least 2."""
    if model.position_embedding != "rope" or model.multi_latent_attention:
        return
    if model.kv_channels is not None:
        head, field = model.kv_channels, "model.kv_channels"
    else:
        head, field = model.hidden_size // heads, "model.hidden_size"
    if head < 1 or not 0 < model.rotary_percent <= 1:
        return  # reported by the ranges / the heads rule
    dim = int(head * model.rotary_percent) if model.rotary_percent < 1 else head
    if model.rotary_percent < 1:
        field = "model.rotary_percent"
    hint = ("model.rotary_percent=1.0" if field == "model.rotary_percent" and head % 2 == 0 else
            f"model.kv_channels={head + 1 if head % 2 else max(2, head)}")
    c.need(dim >= 2 and dim % 2 == 0, field, _get_model(model, field),
           f"RoPE rotates head-dim pairs: int(head dim {head} x model.rotary_percent {model.rotary_percent:g}) = {dim} "
           "must be even and >= 2 (head dim: model.kv_channels, else model.hidden_size / model.num_attention_heads)",
           hint)


def _get_model(model: ModelConfig, field: str):
    return getattr(model, field.split(".", 1)[1])


def _validate_moe(c: Checks, model: ModelConfig) -> None:
    if model.moe_router_topk >= 1:
        c.need(model.moe_router_topk <= model.num_experts, "model.moe_router_topk", model.moe_router_topk,
               f"must be at most model.num_experts={model.num_experts}",
               f"model.moe_router_topk={min(2, model.num_experts)}")
    if model.num_layers >= 1 and model.moe_first_k_dense >= 0:
        c.need(model.moe_first_k_dense < model.num_layers, "model.moe_first_k_dense", model.moe_first_k_dense,
               f"must leave at least one MoE layer of model.num_layers={model.num_layers}", "model.moe_first_k_dense=0")
    # transformer_config.py: "Please use --moe-router-pre-softmax when topk is 1" (softmax over one expert has a
    # zero gradient); the schema has no pre-softmax switch, so top-1 needs sigmoid scores or sinkhorn.
    c.need(not (model.moe_router_topk == 1 and model.moe_router_score_function == "softmax"
                and model.moe_router_load_balancing_type != "sinkhorn"), "model.moe_router_topk", 1,
           "top-1 routing with softmax scores has a zero router gradient (Megatron-Core asks for pre-softmax, "
           "which this schema does not expose)", "model.moe_router_topk=2 or model.moe_router_score_function=sigmoid")
    # moe/router.py SinkhornRouter: "Sinkhorn routing does not support aux loss."
    c.need(model.moe_router_load_balancing_type != "sinkhorn" or model.moe_aux_loss_coeff == 0,
           "model.moe_aux_loss_coeff", model.moe_aux_loss_coeff,
           "sinkhorn load balancing does not take an auxiliary loss", "model.moe_aux_loss_coeff=0.0")
    _validate_moe_routing(c, model)
    # moe/shared_experts.py: "bias is not supported in the shared experts"
    c.need(model.moe_shared_expert_intermediate_size is None or not model.add_bias_linear,
           "model.moe_shared_expert_intermediate_size", model.moe_shared_expert_intermediate_size,
           "shared experts do not support model.add_bias_linear=true (Megatron-Core)",
           "model.moe_shared_expert_intermediate_size=null or model.add_bias_linear=false")


def _validate_moe_routing(c: Checks, model: ModelConfig) -> None:
    """Group-limited routing, expert bias and token dropping (TransformerConfig.__post_init__, moe/router.py)."""
    groups, gtopk = model.moe_router_num_groups, model.moe_router_group_topk
    # transformer_config.py: "When using group limited routing, moe_router_num_groups must be specified."
    # (and groups without a group top-k are ignored by the router: refused, not silently unused)
    alone = "model.moe_router_num_groups" if gtopk is None else "model.moe_router_group_topk"
    c.need((groups is None) == (gtopk is None), alone, groups if gtopk is None else gtopk,
           "group-limited routing needs both model.moe_router_num_groups and model.moe_router_group_topk",
           f"{alone}=null")
    if groups and gtopk and groups >= 1 and gtopk >= 1:
        if c.need(model.num_experts % groups == 0, "model.moe_router_num_groups", groups,
                  f"must divide model.num_experts={model.num_experts}",
                  f"model.moe_router_num_groups={divisor_near(model.num_experts, groups)}"):
            c.need(gtopk <= groups, "model.moe_router_group_topk", gtopk,
                   f"must be at most model.moe_router_num_groups={groups}", f"model.moe_router_group_topk={groups}")
        # moe_utils.group_limited_topk scores each group by its top (topk // group_topk) experts
        c.need(gtopk <= model.moe_router_topk, "model.moe_router_group_topk", gtopk,
               f"must be at most model.moe_router_topk={model.moe_router_topk} (each group is scored by its top "
               "moe_router_topk / moe_router_group_topk experts)", f"model.moe_router_group_topk={min(gtopk, model.moe_router_topk)}")
        per_group = model.num_experts // groups if model.num_experts % groups == 0 else 0
        if per_group:
            c.need(gtopk * per_group >= model.moe_router_topk, "model.moe_router_group_topk", gtopk,
                   f"{gtopk} groups of {per_group} experts cannot hold model.moe_router_topk={model.moe_router_topk}",
                   f"model.moe_router_group_topk={min(groups, -(-model.moe_router_topk // per_group))}")
    # transformer_config.py: "Expert bias for aux-loss-free routing only supports 'sigmoid' ..."
    c.need(not model.moe_router_enable_expert_bias or model.moe_router_score_function == "sigmoid",
           "model.moe_router_enable_expert_bias", True, "aux-loss-free expert bias needs sigmoid router scores",
           "model.moe_router_score_function=sigmoid")
    if model.moe_expert_capacity_factor is not None:
        # transformer_config.py: "moe_expert_capacity_factor only works with aux_loss, seq_aux_loss, ... none"
        c.need(model.moe_router_load_balancing_type != "sinkhorn", "model.moe_expert_capacity_factor",
               model.moe_expert_capacity_factor, "token dropping does not work with sinkhorn load balancing",
               "model.moe_router_load_balancing_type=aux_loss")
    # token_dispatcher.py: "assert self.config.moe_expert_capacity_factor is not None" when padding
    c.need(not model.moe_pad_expert_input_to_capacity or model.moe_expert_capacity_factor is not None,
           "model.moe_pad_expert_input_to_capacity", True, "pads to a capacity: needs model.moe_expert_capacity_factor",
           "model.moe_expert_capacity_factor=1.0")


def validate_precision(job: JobConfig, lay: Layout) -> list[Problem]:
    c = Checks()
    pr, cluster = job.precision, job.cluster
    te = lay.transformer_engine
    c.need(not (te and cluster.gpu == "cpu"), "precision.transformer_engine", pr.transformer_engine,
           "Transformer Engine needs a GPU (this cluster profile is cpu)", "precision.transformer_engine=false")
    if pr.fp8 is not None:
        if is_allowed(pr, "fp8"):
            needs, generation = {"mxfp8": (BLACKWELL, "Blackwell (B200)"),
                                 "blockwise": (HOPPER, "Hopper (H100/H200; Transformer Engine 2.7's block-scaled "
                                                       "GEMM runs on compute capability 9.x only)")}.get(
                pr.fp8, (HOPPER_OR_NEWER, "Hopper or newer (H100/H200/B200)"))
            alternative = ("precision.fp8=null" if cluster.gpu not in HOPPER_OR_NEWER else
                           "precision.fp8=mxfp8" if cluster.gpu in BLACKWELL and pr.fp8 == "blockwise" else
                           "precision.fp8=delayed")
            c.need(cluster.gpu in needs, "precision.fp8", pr.fp8,
                   f"this FP8 recipe needs {generation}; cluster.gpu is {cluster.gpu}", alternative)
        c.need(te, "precision.fp8", pr.fp8, "FP8 needs Transformer Engine layers",
               "precision.fp8=null or precision.transformer_engine=auto on a GPU cluster")
        c.need(pr.dtype in ("bf16", "fp16"), "precision.dtype", pr.dtype, "FP8 training runs on a bf16/fp16 model",
               "precision.dtype=bf16")
    c.need(te or not job.model.multi_latent_attention, "model.multi_latent_attention", True,
           "multi-latent attention needs Transformer Engine attention (Megatron-Core's local attention cannot "
           "take MLA's head sizes)", "a GPU cluster profile (cluster=h100) or model.multi_latent_attention=false")
    c.need(not pr.fp8_param or pr.fp8 is not None, "precision.fp8_param", pr.fp8_param,
           "FP8 parameters need an FP8 recipe", "precision.fp8=delayed or precision.fp8_param=false")
    # optimizer/grad_scaler.py: fp16's DynamicGradScaler keeps its scale in a device='cuda' tensor.
    c.need(not (pr.dtype == "fp16" and cluster.gpu == "cpu"), "precision.dtype", pr.dtype,
           "fp16 training needs a GPU (Megatron-Core's loss scaler is a CUDA tensor); this cluster profile is cpu",
           "precision.dtype=bf16 or precision.dtype=fp32")
    # Megatron-LM arguments.py refused "Expert parallelism is not supported with fp16 training." until
    # Megatron-LM #2495 (core 0.16) lifted it; stricter here: fp16 MoE with EP (loss scaling of the router's
    # aux loss across expert groups) has not been run by this launcher, bf16 has.
    c.need(not (pr.dtype == "fp16" and job.model.num_experts and job.parallel.expert > 1), "precision.dtype",
           pr.dtype, "expert parallelism (parallel.expert > 1) is not run in fp16 here (Megatron-LM refused it "
           "before #2495)", "precision.dtype=bf16 or parallel.expert=1")
    # Megatron-LM arguments.py: "--fp8-param-gather only supported with distributed optimizer" (the rank wing
    # maps fp8_param to fp8_param_gather); without it the FP8 weights would never be updated.
    c.need(not pr.fp8_param or job.parallel.distributed_optimizer, "precision.fp8_param", pr.fp8_param,
           "FP8 parameters are re-quantised by the distributed optimizer under fp8_param_gather; Megatron-LM "
           "asserts FP8 param gather needs the distributed optimizer",
           "parallel.distributed_optimizer=true or precision.fp8_param=false")
    return c.problems


OPTIMIZER_DTYPE_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")


def validate_optimizer_levers(job: JobConfig, lay: Layout) -> list[Problem]:
    """The precision-aware optimizer and the optimizer's CPU offload: Megatron-Core's OptimizerConfig.__post_init__
    and Megatron-LM's validate_args (arguments.py) assert these on every rank after the model is built; here they
    are one line each before anything runs."""
    c = Checks()
    pr, t, par = job.precision, job.train, job.parallel
    lowered = [n for n in OPTIMIZER_DTYPE_FIELDS if getattr(pr, n) != "fp32"]
    if not pr.precision_aware_optimizer:
        # optimizer_config.py: "main_grads_dtype can only be fp32 when not using precision-aware optimizer" (x4)
        for name in lowered:
            c.need(False, f"precision.{name}", getattr(pr, name), "a dtype other than fp32 needs the "
                   "precision-aware optimizer (Megatron-Core asserts fp32 without it)",
                   f"precision.precision_aware_optimizer=true or precision.{name}=fp32")
        # arguments.py: "The optimizer cpu offload must be used in conjunction with --use-precision-aware-optimizer"
        c.need(not t.optimizer_cpu_offload, "train.optimizer_cpu_offload", True, "the CPU offload reuses the "
               "precision-aware optimizer's code path (Megatron-LM asserts both are on)",
               "precision.precision_aware_optimizer=true or train.optimizer_cpu_offload=false")
    else:
        # optimizer_config.py: "--use-precision-aware-optimizer only supported with distributed optimizer"
        c.need(par.distributed_optimizer, "precision.precision_aware_optimizer", True, "the precision-aware "
               "optimizer needs the distributed optimizer (Megatron-Core asserts it)",
               "parallel.distributed_optimizer=true or precision.precision_aware_optimizer=false")
        # stricter than Megatron-Core: Megatron-FSDP keeps its own main weights and gradients
        # (megatron_fsdp_main_params_dtype / _grads_dtype); the two together have not been run here
        c.need(not par.megatron_fsdp, "precision.precision_aware_optimizer", True, "Megatron-FSDP keeps its own "
               "main weights and gradients; the precision-aware optimizer is not run with it here",
               "precision.precision_aware_optimizer=false or parallel.megatron_fsdp=false")
        # optimizer_config.py: without the CPU offload it is TE's FusedAdam ("requires FusedAdam from
        # TransformerEngine, but not found"); no TE without a GPU
        c.need(t.optimizer_cpu_offload or job.cluster.gpu != "cpu", "precision.precision_aware_optimizer", True,
               "on GPUs it is Transformer Engine's FusedAdam, which a cpu cluster has not (the CPU offload's hybrid "
               "optimizer needs no TE)", "train.optimizer_cpu_offload=true or precision.precision_aware_optimizer=false")
    # arguments.py: "--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32 is set"
    # (a bf16 main gradient is the bf16 gradient buffer: grad_reduce_in_fp32=false)
    c.need(pr.main_grads_dtype == "fp32" or not pr.grad_reduce_in_fp32, "precision.main_grads_dtype",
           pr.main_grads_dtype, "bf16 main gradients are a bf16 gradient buffer, but precision.grad_reduce_in_fp32 "
           "keeps it in fp32 (Megatron-LM asserts the two agree)",
           "precision.grad_reduce_in_fp32=false or precision.main_grads_dtype=fp32")
    if t.optimizer_cpu_offload:
        # arguments.py: "When --fp8-param-gather is enabled, the optimizer cpu offload must be used in
        # conjunction with --fp8-recipe delayed"
        c.need(not pr.fp8_param or pr.fp8 == "delayed", "train.optimizer_cpu_offload", True, "FP8 parameters "
               f"with the CPU offload need delayed scaling (Megatron-LM asserts it); precision.fp8 is {pr.fp8}",
               "precision.fp8=delayed or precision.fp8_param=false")
        # measured (megatron-core 0.19.2, CPU): the distributed optimizer rebuilds HybridDeviceOptimizer over the
        # fp32 parameters' shards, which are views of the parameters (distrib_optimizer.py
        # _build_model_and_main_param_groups), and torch refuses them: "can't optimize a non-leaf Tensor"
        c.need(pr.dtype != "fp32", "train.optimizer_cpu_offload", True, "an fp32 model cannot be offloaded "
               "(Megatron-Core rebuilds the hybrid optimizer over views of fp32 parameters, which torch refuses)",
               "precision.dtype=bf16")
        # hybrid_optimizer.py: the host step is torch's AdamW on fp32 copies (param_update_in_fp32=True); the
        # stored dtypes would be ignored, and the planner would count memory the run does not save
        for name in ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            c.need(getattr(pr, name) == "fp32", f"precision.{name}", getattr(pr, name), "with the CPU offload "
                   "the optimizer state is torch AdamW's fp32 (Megatron-Core's HybridDeviceOptimizer); a lower "
                   "dtype would not be used", f"precision.{name}=fp32 or train.optimizer_cpu_offload=false")
        c.need(t.optimizer_offload_fraction > 0, "train.optimizer_offload_fraction", t.optimizer_offload_fraction,
               "0 leaves every parameter's state on the GPU", "train.optimizer_offload_fraction=1.0 or "
               "train.optimizer_cpu_offload=false", severity="warning")
    else:
        for name, default in (("optimizer_offload_fraction", 1.0), ("overlap_cpu_optimizer_d2h_h2d", False)):
            c.need(getattr(t, name) == default, f"train.{name}", getattr(t, name),
                   "has no effect without the optimizer's CPU offload",
                   f"train.optimizer_cpu_offload=true (with precision.precision_aware_optimizer=true)",
                   severity="warning")
    return c.problems


def validate_train(job: JobConfig, lay: Layout) -> list[Problem]:
    """Batch, length and optimizer rules (ranges are in ``BOUNDS``; Megatron-LM arguments.py for the rest)."""
    c = Checks()
    t = job.train
    dp = lay.dp
    if dp and in_bounds(job, "train.micro_batch_size", "train.global_batch_size"):
        unit = t.micro_batch_size * dp
        if unit > t.global_batch_size and job.nodes > 1 and t.global_batch_size >= t.micro_batch_size * lay.pp:
            # more data-parallel replicas than a plausible batch (one that fills the pipeline once) has micro
            # batches: the node count is what is wrong (a batch grown to fit 100,000 nodes is no alternative); the
            # largest node count whose DP divides the batch (DP x n / nodes replicas on n nodes). A batch below that
            # is itself the mistake, and the divisibility line below names it.
            start = min(job.nodes - 1, job.nodes * t.global_batch_size // unit)
            fits = next((n for n in range(start, 0, -1) if dp * n % job.nodes == 0
                         and t.global_batch_size % (t.micro_batch_size * dp * n // job.nodes) == 0), None)
            c.need(False, "nodes", job.nodes,
                   f"gives DP={dp} data-parallel replicas, more than the global batch holds micro batches "
                   f"(train.global_batch_size={t.global_batch_size} / train.micro_batch_size={t.micro_batch_size}: "
                   "every replica needs at least one each step)",
                   f"nodes={fits}" if fits else f"train.global_batch_size={unit}")
            return c.problems
        c.need(t.global_batch_size % unit == 0, "train.global_batch_size", t.global_batch_size,
               f"must be divisible by train.micro_batch_size x DP = {t.micro_batch_size}x{dp} = {unit}",
               f"train.global_batch_size={round_up(max(t.global_batch_size, unit), unit)}")
    c.need((t.train_steps is None) != (t.train_tokens is None),
           "train.train_steps" if t.train_steps is not None else "train.train_tokens",
           t.train_steps if t.train_steps is not None else t.train_tokens,
           "set exactly one of train.train_steps and train.train_tokens",
           "train.train_tokens=null" if t.train_steps is not None else "train.train_steps=1000")
    if t.train_steps is not None and in_bounds(job, "train.train_steps", "train.warmup_steps"):
        c.need(t.warmup_steps < t.train_steps, "train.warmup_steps", t.warmup_steps,
               f"must be shorter than train.train_steps={t.train_steps}", f"train.warmup_steps={t.train_steps // 10}")
    if in_bounds(job, "train.lr", "train.min_lr"):
        # Megatron-LM arguments.py: "assert args.min_lr <= args.lr"
        c.need(t.min_lr <= t.lr, "train.min_lr", t.min_lr, f"must not exceed train.lr={t.lr:g}",
               f"train.min_lr={t.lr / 10:g}")
    if t.wsd_decay_steps is not None and t.train_steps is not None and in_bounds(job, "train.train_steps"):
        c.need(t.wsd_decay_steps <= t.train_steps, "train.wsd_decay_steps", t.wsd_decay_steps,
               f"must not exceed train.train_steps={t.train_steps}", f"train.wsd_decay_steps={max(1, t.train_steps // 10)}")
    if t.recompute_num_layers is not None and t.recompute_num_layers >= 1 and is_allowed(t, "recompute"):
        # transformer_config.py: with full recompute "recompute_num_layers must be between 1 and
        # num_layers_per_pipeline_rank"; with selective "recompute_num_layers must be None".
        c.need(t.recompute == Recompute.FULL, "train.recompute_num_layers", t.recompute_num_layers,
               f"is only used with train.recompute=full (got {t.recompute})",
               "train.recompute_num_layers=null or train.recompute=full")
        # multi_token_prediction.py: "recompute_num_layers must be 1 for MTP recompute"
        c.need(not (t.recompute == Recompute.FULL and job.model.mtp_num_layers and t.recompute_num_layers != 1),
               "train.recompute_num_layers",
               t.recompute_num_layers, "full recompute with multi-token prediction (model.mtp_num_layers > 0) "
               "recomputes one layer at a time", "train.recompute_num_layers=1 or train.recompute_num_layers=null")
        per_chunk = min((len(chunk) for stage in lay.chunk_layers for chunk in stage), default=0)
        c.need(t.recompute != Recompute.FULL or t.recompute_num_layers <= max(per_chunk, 1),
               "train.recompute_num_layers", t.recompute_num_layers,
               f"must be at most the layers of one pipeline chunk ({per_chunk})",
               f"train.recompute_num_layers={max(per_chunk, 1)} or train.recompute_num_layers=null")
    if t.spike_factor is not None and in_bounds(job, "train.spike_factor", "train.spike_window"):
        interval = job.checkpoint.save_interval
        # a spike is replayed from the last checkpoint before it: without periodic checkpoints there is none
        if c.need(interval > 0, "checkpoint.save_interval", interval,
                  "train.spike_factor rolls a spike back to the last checkpoint and replays it: it needs periodic "
                  "checkpoints", f"checkpoint.save_interval={max(t.spike_window, 50)} or train.spike_factor=null"):
            # the statistic covers at most what one rollback replays, so a replay re-judges a spike against the
            # same kind of history the first pass had (launcher/rank/spikes.py)
            c.need(t.spike_window <= interval, "train.spike_window", t.spike_window,
                   f"must be at most checkpoint.save_interval={interval} (a rollback replays at most one interval)",
                   f"train.spike_window={interval} or checkpoint.save_interval={t.spike_window}")
    valid_share = _split_share(job.data.split, 1)
    if t.eval_interval and valid_share == 0:
        # BlendedMegatronDatasetBuilder builds no validation dataset for a 0 share: every evaluation would be skipped
        c.need(False, "train.eval_interval", t.eval_interval,
               f"evaluation every {t.eval_interval} steps, but data.split={job.data.split!r} gives validation no "
               "share, so no evaluation would ever run", "train.eval_interval=0 or data.split='98,2,0'",
               severity="warning")
    return c.problems


def _split_share(split: str, index: int) -> float | None:
    """The share of data.split's train/valid/test entry ``index``, or None when the split does not parse (its own
    rule reports that)."""
    try:
        parts = [float(x) for x in str(split).split(",")]
    except ValueError:
        return None
    return parts[index] / sum(parts) if len(parts) == 3 and sum(parts) > 0 else None


def validate_cuda_graphs(job: JobConfig, lay: Layout) -> list[Problem]:
    """train.cuda_graph_*: Megatron-Core's TransformerConfig.__post_init__ and Megatron-LM's validate_args
    (megatron-core 0.19.2) assert these on every rank once the model is configured; here one line each, before
    anything runs. Rules marked stricter are ours, with the reason."""
    c = Checks()
    t, m = job.train, job.model
    impl, mods = t.cuda_graph_impl, list(t.cuda_graph_modules)
    if impl == "none":
        # transformer_config.py: "cuda_graph_modules has no effect when cuda_graph_impl="none""
        for name, unset in (("cuda_graph_modules", not mods), ("cuda_graph_warmup_steps", t.cuda_graph_warmup_steps == 3)):
            c.need(unset, f"train.{name}", getattr(t, name), "has no effect without CUDA graphs",
                   "train.cuda_graph_impl=local or train.cuda_graph_impl=transformer_engine", severity="warning")
        return c.problems
    unknown = [x for x in mods if x not in CUDA_GRAPH_MODULES]
    # cuda_graph_config.py: CudaGraphModule[name] (KeyError for anything else; "mamba" is for hybrid models)
    c.need(not unknown, "train.cuda_graph_modules", mods, f"unknown module(s) {unknown}; known: "
           f"{', '.join(CUDA_GRAPH_MODULES)} (empty captures the whole layer)",
           respelled_list("train.cuda_graph_modules", mods, CUDA_GRAPH_MODULES) + "train.cuda_graph_modules=[]")
    where = "train.cuda_graph_impl"
    # torch.cuda.graph captures CUDA streams; a CPU rank has none
    c.need(job.cluster.gpu != "cpu", where, impl, "CUDA graphs need CUDA (torch.cuda.graph); this cluster "
           "profile is cpu", "train.cuda_graph_impl=none")
    # cuda_graphs.py TECudaGraphHelper: "CUDA Graphs are not supported without TE." (make_graphed_callables)
    c.need(impl != "transformer_engine" or lay.transformer_engine, where, impl, "the transformer_engine "
           "implementation is TE's make_graphed_callables, and this job plans no Transformer Engine layers",
           "train.cuda_graph_impl=local or precision.transformer_engine=auto")
    # stricter (no upstream schedule to assert): the zero-bubble executor (launcher/rank/zb_executor.py) splits
    # each backward and defers the weight-gradient GEMMs as Python closures queued in models/deferred_wgrad.py's
    # WeightGradStore while an autograd function's backward runs; a replayed backward graph runs its kernels
    # without that Python, so no W work would be queued (weights silently not trained), and Megatron-Core builds
    # local graphs (create_cudagraphs) and TE's per-microbatch capture order only for its own 1F1B/interleaved
    c.need(job.schedule.kind not in Schedule.ZERO_BUBBLE, where, impl, f"schedule.kind={job.schedule.kind} "
           "defers weight gradients as Python work queued during backward, which a replayed backward graph "
           "never queues", "train.cuda_graph_impl=none")
    # transformer_config.py: "full recompute is only supported with full iteration CUDA graph."
    c.need(t.recompute != Recompute.FULL, "train.recompute", t.recompute, "full recompute with per-layer CUDA "
           "graphs (Megatron-Core asserts only full_iteration graphs take it; not built here)",
           "train.recompute=selective or train.cuda_graph_impl=none")
    # stricter: Megatron-LM runs Megatron-FSDP in megatron_fsdp_cuda_graph_mode under CUDA graphs
    # (training.py); that mode is not wired here
    c.need(not job.parallel.megatron_fsdp, where, impl, "Megatron-FSDP needs its CUDA-graph-safe mode "
           "(megatron_fsdp_cuda_graph_mode), which this launcher does not set", "train.cuda_graph_impl=none")
    _cuda_graph_modules(c, job, impl, mods)
    if impl == "transformer_engine":
        env = job.cluster.env
        # arguments.py / cuda_graphs.py: "Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access when using
        # CUDA Graph with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
        c.need("expandable_segments:True" not in env.get("PYTORCH_CUDA_ALLOC_CONF", "")
               or env.get("NCCL_GRAPH_REGISTER", "") == "0", "cluster.env.PYTORCH_CUDA_ALLOC_CONF",
               env.get("PYTORCH_CUDA_ALLOC_CONF"), "expandable segments with TE's CUDA graphs need "
               "NCCL_GRAPH_REGISTER=0 (Megatron asserts it: illegal memory access otherwise)",
               "+cluster.env.NCCL_GRAPH_REGISTER=0")
        c.need(t.cuda_graph_warmup_steps < lay.steps, "train.cuda_graph_warmup_steps", t.cuda_graph_warmup_steps,
               f"the graphs are captured after this many steps and the run has {lay.steps}",
               f"train.cuda_graph_warmup_steps={max(0, lay.steps - 1)}", severity="warning")
    return c.problems


MOE_OFFLOAD_MODULES = ("expert_fc1", "moe_act", "fused_group_mlp")
"""offload_modules inside the routed experts (moe/experts.py)."""


def validate_activation_offload(job: JobConfig, lay: Layout) -> list[Problem]:
    """train.activation_offload_*: Megatron-Core's TransformerConfig.__post_init__ and Megatron-LM's validate_args
    (megatron-core 0.19.2) on fine_grained_activation_offloading / offload_modules, one line each, plus the rules
    marked stricter: a module whose offload context wraps nothing in the layers this job builds (Megatron-Core runs
    it as a no-op) is refused, since the plan would count memory the run keeps."""
    c = Checks()
    t, m, field = job.train, job.model, "train.activation_offload_modules"
    mods = list(t.activation_offload_modules)
    if not mods:
        for name, default in (("activation_offload_fraction", 1.0), ("min_offloaded_tensor_size", 1 << 20)):
            c.need(getattr(t, name) == default, f"train.{name}", getattr(t, name), "has no effect without "
                   "train.activation_offload_modules", f"train.{name}={default:g}", severity="warning")
        return c.problems
    moe = bool(m.num_experts and m.num_experts > 1)
    rec = set(t.recompute_modules or ["core_attn"]) if t.recompute == Recompute.SELECTIVE else set()
    off = "train.activation_offload_modules=[]"

    def without(*names: str) -> str:
        rest = [x for x in mods if x not in names]
        return f"train.activation_offload_modules=[{','.join(rest)}]" + (f" or {off}" if rest else "")
    unknown = [x for x in mods if x not in ACTIVATION_OFFLOAD_MODULES]
    # transformer_config.py: "Invalid choices for offload_modules: {invalid_modules}. Allowed modules are: ..."
    c.need(not unknown, field, mods, f"unknown module(s) {unknown}; known: {', '.join(ACTIVATION_OFFLOAD_MODULES)}",
           respelled_list(field, mods, ACTIVATION_OFFLOAD_MODULES) + without(*unknown))
    # fine_grained_activation_offload.py: pinned host buffers and torch.cuda.Stream / Event copies; a CPU rank has none
    c.need(job.cluster.gpu != "cpu", field, mods, "activation offloading copies to pinned host memory on CUDA "
           "streams; this cluster profile is cpu", off)
    # arguments.py: "Fine-grained activation offloading is only supported with transformer_engine implementation"
    c.need(lay.transformer_engine, field, mods, "fine-grained activation offloading is only supported with the "
           "transformer_engine implementation (Megatron-LM asserts it), and this job plans no Transformer Engine "
           "layers", off)
    # stricter: the offload manager is reset by Megatron-Core's own schedules (schedules.py off_interface.reset())
    # and reloads in their backward order; launcher/rank/zb_executor.py runs neither, and its deferred W closures
    # would hold tensors the manager has already handed back to its pool
    c.need(job.schedule.kind not in Schedule.ZERO_BUBBLE, field, mods, f"schedule.kind={job.schedule.kind}: the "
           "offload manager follows Megatron-Core's 1F1B/interleaved schedules (reset and reload order), which the "
           "zero-bubble executor does not run", off)
    # stricter: only TE's capture path drives the offload events (transformer_layer.py _te_cuda_graph_capture,
    # offload_module_in_cuda_graph; cuda_graphs.py TECudaGraphHelper's warm-up hooks); the local CudaGraphManager
    # does not
    c.need(t.cuda_graph_impl != "local", "train.cuda_graph_impl", t.cuda_graph_impl, "Megatron-Core drives "
           "activation offloading inside Transformer Engine's CUDA graphs only, not the local implementation's",
           "train.cuda_graph_impl=transformer_engine or " + off)
    # stricter: under full recompute a layer keeps only its input; the modules' inputs are recomputed in backward,
    # so there is nothing to offload (Megatron-LM's later 'layer_input' module is the offload for that case)
    c.need(t.recompute != Recompute.FULL, "train.recompute", t.recompute, "a fully recomputed layer keeps only its "
           "input, so the offloaded modules hold nothing", "train.recompute=selective or " + off)
    # transformer_config.py: "attn_proj cannot be set to offload_modules alone without core_attn because the
    # input of attn_proj is the output of core_attn, which is needed in core_attn.backward()."
    c.need("attn_proj" not in mods or "core_attn" in mods, field, mods, "attn_proj needs core_attn (its input is "
           "core attention's output, which core_attn.backward() needs)",
           f"train.activation_offload_modules=[{','.join(['core_attn'] + mods)}] or " + without("attn_proj"))
    # stricter: attention.py runs a recomputed core attention through _checkpointed_attention_forward, outside the
    # offload context: nothing is offloaded
    c.need("core_attn" not in mods or "core_attn" not in rec, field, mods, "core_attn is recomputed "
           "(train.recompute=selective recomputes core_attn unless train.recompute_modules says otherwise), and a "
           "recomputed attention runs outside the offload context", "train.recompute=none or "
           + without("core_attn", "attn_proj"))
    # transformer_config.py: "Cannot offload {offload_inside_moe} while recomputing the entire MoE layer."
    inside = [x for x in mods if x in MOE_OFFLOAD_MODULES]
    c.need(not (inside and "moe" in rec), field, mods, f"cannot offload {inside} while recomputing the entire MoE "
           "layer ('moe' in train.recompute_modules)", without(*inside))
    # transformer_config.py: "fused_group_mlp requires use_transformer_engine_op_fuser." (not set by this launcher)
    c.need("fused_group_mlp" not in mods, field, mods, "fused_group_mlp requires Transformer Engine's op fuser "
           "(use_transformer_engine_op_fuser), which this launcher does not set", without("fused_group_mlp"))
    # stricter: the expert modules exist only in MoE layers (moe/experts.py)
    c.need(moe or not inside, field, mods, f"{inside} offload inside routed experts, and this model has none",
           without(*inside))
    # stricter: the TE spec fuses the pre-attention norm into linear_qkv (input_layernorm is IdentityOp;
    # transformer_layer.py offloads attn_norm only for a real norm); MLA layers keep a separate norm
    c.need("attn_norm" not in mods or m.multi_latent_attention, field, mods, "Transformer Engine fuses this "
           "model's attention norm into linear_qkv (no separate norm input to offload; qkv_linear offloads it)",
           without("attn_norm"))
    # stricter: the same for the MLP norm of dense layers (fused into linear_fc1); MoE layers keep TENorm
    c.need("mlp_norm" not in mods or moe, field, mods, "Transformer Engine fuses a dense layer's MLP norm into "
           "linear_fc1 (no separate norm input to offload)", without("mlp_norm"))
    if t.cuda_graph_impl == "transformer_engine":
        graphs = set(t.cuda_graph_modules)
        # stricter: Megatron-Core hands offloading inside a TE graph to the graph's own stream only for the attention
        # and dense-MLP scopes (transformer_layer.py offload_module_in_cuda_graph); a whole-layer or whole-MoE graph
        # would capture the offload hooks' copies without it
        captured = set(mods) if not graphs else set(mods) & set(MOE_OFFLOAD_MODULES) if "moe" in graphs else set()
        c.need(not captured, field, mods, "these modules would run inside " + ("the whole-layer CUDA graph" if not graphs
               else "the MoE block's CUDA graph") + ", which Megatron-Core does not offload from",
               "train.cuda_graph_modules=[attn] or " + without(*captured))
        # transformer_layer.py: "Offloading modules captured in cuda graph requires TE>=2.14.0." (and torch >= 2.9);
        # the image's Transformer Engine is 2.7 (Dockerfile: NGC 25.09)
        in_attn = [x for x in mods if x in ("qkv_linear", "core_attn", "attn_proj")] if "attn" in graphs else []
        c.need(not in_attn, field, mods, f"offloading {in_attn} inside the attention CUDA graph needs Transformer "
               "Engine >= 2.14 (Megatron-Core asserts it); the image's is 2.7 (NGC 25.09)",
               "train.cuda_graph_modules=[" + ",".join(sorted(graphs - {"attn"})) + "] or " + without(*in_attn))
        # transformer_layer.py _set_offload_modules: "attn_norm offloading is not supported with attn cudagraph.
        # Disabling attn_norm offloading."
        c.need("attn_norm" not in mods or (graphs and "attn" not in graphs), field, mods, "attn_norm offloading is "
               "not supported with attention inside a CUDA graph (Megatron-Core disables it)", without("attn_norm"))
        # "mlp_norm offloading is not supported with the current cudagraph scope. Disabling mlp_norm offloading."
        # (an MoE layer's with attn or moe_router graphed)
        c.need("mlp_norm" not in mods or not moe or not (not graphs or {"attn", "moe_router"} & graphs), field, mods,
               "mlp_norm offloading is not supported with attn or moe_router in a CUDA graph (Megatron-Core disables "
               "it)", without("mlp_norm"))
    value = job.cluster.env.get("NVTE_CPU_OFFLOAD_V1")
    # arguments.py: "For fine-grained activation offloading with TE >= 2.10.0, NVTE_CPU_OFFLOAD_V1 should be set to 1
    # to avoid offloading weights." (the job's environment sets it unless the job gives another value)
    c.need(value is None or str(value) == "1", "cluster.env.NVTE_CPU_OFFLOAD_V1", value, "must be 1 with activation "
           "offloading (Megatron-LM asserts it with TE >= 2.10: otherwise TE offloads weights too)",
           "cluster.env.NVTE_CPU_OFFLOAD_V1=1")
    c.need(t.activation_offload_fraction > 0, "train.activation_offload_fraction", t.activation_offload_fraction,
           "offloads no group", "train.activation_offload_fraction=1", severity="warning")
    return c.problems


def _cuda_graph_modules(c: Checks, job: JobConfig, impl: str, mods: list) -> None:
    """TransformerConfig.__post_init__'s cuda_graph_modules rules (transformer_config.py, megatron-core 0.19.2)."""
    m, t, field = job.model, job.train, "train.cuda_graph_modules"
    moe = bool(m.num_experts and m.num_experts > 1)
    moe_mods = [x for x in mods if x in ("moe", "moe_router", "moe_preprocess")]
    given = mods
    if impl == "local" and {"moe_router", "moe_preprocess"} & set(mods):  # Megatron-Core appends the other one
        mods = mods + [x for x in ("moe_router", "moe_preprocess") if x not in mods]
    # "moe cuda graph is only supported for MoE."
    c.need(moe or not moe_mods, field, given, "MoE modules in a dense model", "train.cuda_graph_modules=[attn]")
    # "cuda_graph_modules must not contain both moe and moe_router."
    c.need(not ("moe" in mods and "moe_router" in mods), field, given, "moe already contains moe_router (and the "
           "local implementation captures moe_router with moe_preprocess)",
           "train.cuda_graph_modules=[attn,moe_router]")
    # "moe_preprocess cuda graph is only supported with moe_router cuda graph." (local adds moe_router itself)
    c.need("moe_preprocess" not in mods or "moe_router" in mods, field, given,
           "moe_preprocess needs moe_router", "train.cuda_graph_modules=[attn,moe_router,moe_preprocess]")
    if moe:
        pattern = [i >= m.moe_first_k_dense and i % m.moe_layer_freq == 0 for i in range(m.num_layers)]
        # "mlp cuda graph is only supported for dense layers, but not found in the model."
        c.need(not all(pattern) or "mlp" not in mods, field, given, "every layer is an MoE layer, so there is "
               "no dense MLP to capture", "train.cuda_graph_modules=[attn]")
        padded = m.moe_expert_capacity_factor is not None and m.moe_pad_expert_input_to_capacity
        # "moe cuda graph is only supported with drop-padding MoE."; stricter: the whole layer (empty list)
        # contains the MoE block too, whose dropless dispatch copies token counts to the host mid-layer
        c.need(padded or ("moe" not in mods and mods), field, given, "capturing the MoE block needs "
               "drop-and-pad MoE (fixed shapes: model.moe_expert_capacity_factor with "
               "model.moe_pad_expert_input_to_capacity); a dropless dispatch syncs with the host",
               "train.cuda_graph_modules=[attn,moe_router]")
        # "moe_preprocess cuda graph is not supported when there are DtoH copies and synchronizations in the
        # preprocess step." (alltoall with a capacity factor but no padding)
        c.need(padded or m.moe_token_dispatcher_type != "alltoall" or m.moe_expert_capacity_factor is None
               or "moe_preprocess" not in mods, field, given, "the alltoall dispatcher's preprocess with a "
               "capacity factor copies to the host" + (" (the local implementation captures it with moe_router)"
                                                       if impl == "local" else ""),
               "train.cuda_graph_modules=[attn]" if impl == "local" else "train.cuda_graph_modules=[attn,moe_router]")
        if job.parallel.moe_a2a_overlap:
            # stricter: the combined 1F1B schedule runs each layer as nodes of its own (models/gpt/
            # fine_grained_callables.py) and replays only TE's graphs there (layer._te_cuda_graph_replay); the local
            # implementation's graphs hang off the layer's __call__, which those nodes do not go through
            c.need(impl == "transformer_engine", "train.cuda_graph_impl", impl, "the MoE all-to-all overlap "
                   "(parallel.moe_a2a_overlap) replays only Transformer Engine's graphs",
                   "train.cuda_graph_impl=transformer_engine")
            # "CUDA graph scope on moe and mlp is not supported with overlap_moe_expert_parallel_comm" (TE impl);
            # stricter: also the whole layer and the local impl, since the overlap splits each layer's MLP into
            # dispatch / experts / combine nodes of its own schedule
            c.need(mods and "moe" not in mods and "mlp" not in mods, field, given, "the MoE all-to-all overlap "
                   "(parallel.moe_a2a_overlap) schedules the MLP's parts itself", "train.cuda_graph_modules=[attn]")
    rec = set(t.recompute_modules or ["core_attn"]) if t.recompute == Recompute.SELECTIVE else set()
    whole = not mods
    # "attention dropout is not supported with graphed attention recomputation."
    c.need(not (m.attention_dropout and (whole or "attn" in mods) and "core_attn" in rec), "model.attention_dropout",
           m.attention_dropout, "recomputed core attention inside a CUDA graph cannot draw dropout's random "
           "numbers", "model.attention_dropout=0.0 or train.recompute=none")
    # "hidden dropout is not supported with graphed MLP/MoE recomputation."
    graphed = {"mlp": whole or "mlp" in mods, "moe": whole or "moe" in mods}
    c.need(not (m.hidden_dropout and any(graphed[k] and k in rec for k in graphed)), "model.hidden_dropout",
           m.hidden_dropout, "recomputed MLP/MoE inside a CUDA graph cannot draw dropout's random numbers",
           "model.hidden_dropout=0.0 or train.recompute=none")
    # "moe recompute is not supported with moe_router CUDA graph with: --cuda-graph-impl transformer_engine."
    c.need(not (impl == "transformer_engine" and "moe" in rec and "moe_router" in mods), "train.recompute_modules",
           t.recompute_modules, "MoE recompute around TE's moe_router graph", "train.recompute_modules=[core_attn]")
