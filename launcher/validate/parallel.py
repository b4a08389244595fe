"""Cross-field rules of the parallel section: sizes against the world, what TP/SP/CP/EP must divide, the layer
split over (virtual) pipeline stages, the communication overlaps, Megatron-FSDP, recompute modules and the MoE
dispatchers (parallel_state.initialize_model_parallel, TransformerConfig/ModelParallelConfig, the
tensor-parallel layers, Megatron-LM's arguments.py). Login-node code.
"""
from __future__ import annotations

import math

from launcher.core import Layout
from launcher.core.cuda_env import PRE_BLACKWELL, max_connections
from launcher.fields import get_value
from launcher.problems import Problem
from launcher.schema import JobConfig, ModelConfig, ParallelConfig, Recompute
from launcher.validate.generic import Checks, divisor_near, in_bounds, respelled_list, round_up


SIZES = ("parallel.tensor", "parallel.pipeline", "parallel.context", "parallel.expert", "nodes", "cluster.gpus_per_node")


def _validate_flex_dispatcher(c: Checks, job: JobConfig, lay: Layout) -> None:
    """moe_token_dispatcher_type=flex: DeepEP / HybridEP kernels (token_dispatcher.MoEFlexTokenDispatcher)."""
    model = job.model
    if not model.num_experts or model.moe_token_dispatcher_type != "flex":
        return
    f = "model.moe_token_dispatcher_type"
    if not c.need(lay.transformer_engine, f, "flex", "the flex dispatcher's DeepEP/HybridEP kernels run on GPUs "
                  "only (GPU clusters with Transformer Engine)", f"{f}=alltoall"):
        return
    deepep = model.moe_flex_dispatcher_backend == "deepep"
    # token_dispatcher.py: "DeepEP dispatcher requires TPxEP > 1"
    c.need(not deepep or lay.tp * lay.ep > 1, f, "flex", "the deepep backend needs parallel.tensor x "
           "parallel.expert > 1", "parallel.expert=2 or model.moe_token_dispatcher_type=alltoall")
    # transformer_config.py: "Flex token dispatcher with deepep backend does not support moe_pad_expert_input_to_capacity"
    c.need(not (deepep and model.moe_pad_expert_input_to_capacity), "model.moe_pad_expert_input_to_capacity", True,
           "the flex dispatcher's deepep backend does not pad to capacity", "model.moe_flex_dispatcher_backend=hybridep")


def validate_parallel(job: JobConfig, lay: Layout) -> list[Problem]:
    """Layout rules: parallel_state.initialize_model_parallel, TransformerConfig/ModelParallelConfig and the
    tensor-parallel layers (megatron/core/tensor_parallel/layers.py ``divide``)."""
    c = Checks()
    p, model, cluster = job.parallel, job.model, job.cluster
    # Without usable sizes (each reported by validate_bounds) no layout rule can be stated.
    if not in_bounds(job, *SIZES) or (p.expert_tensor is not None and not in_bounds(job, "parallel.expert_tensor")):
        return c.problems
    world, mp = lay.world, lay.model_parallel
    # parallel_state.py: "world_size (W) is not divisible by TP x PP x CP"
    if c.need(lay.dp > 0, _world_culprit(job, lay), get_value(job, _world_culprit(job, lay)),
              f"parallel.tensor x parallel.pipeline x parallel.context = {p.tensor}x{p.pipeline}x{p.context} = {mp} "
              f"must divide the world size nodes x cluster.gpus_per_node = {job.nodes}x{cluster.gpus_per_node} = {world}",
              _world_fix(job, lay)):
        if p.data is not None:
            c.need(p.data == lay.dp, "parallel.data", p.data,
                   f"is derived: world {world} / (TP x PP x CP = {mp}) = {lay.dp}", f"parallel.data={lay.dp} or parallel.data=null")
    c.need(p.tensor <= cluster.gpus_per_node, "parallel.tensor", p.tensor,
           f"tensor parallelism must stay inside one node (cluster.gpus_per_node={cluster.gpus_per_node})",
           f"parallel.tensor={divisor_near(cluster.gpus_per_node, p.tensor)}")
    _validate_tensor_widths(c, p, model)
    if lay.sequence_parallel and in_bounds(job, "model.seq_length"):
        shards = lay.tp * (2 * lay.cp if lay.cp > 1 else 1)
        c.need(model.seq_length % shards == 0, "parallel.sequence_parallel", True,
               f"model.seq_length={model.seq_length} must be divisible by TP{' x 2CP' if lay.cp > 1 else ''} = {shards}",
               f"model.seq_length={round_up(model.seq_length, shards)} or parallel.sequence_parallel=false")
    _validate_overlap(c, p, lay)
    if in_bounds(job, "model.num_layers"):
        _validate_layer_split(c, p, model, lay)
    if p.context > 1:
        if in_bounds(job, "model.seq_length"):
            # Megatron-LM arguments.py: "seq-length should be a multiple of 2 * context-parallel-size"
            c.need(model.seq_length % (2 * p.context) == 0, "parallel.context", p.context,
                   f"model.seq_length={model.seq_length} must be divisible by 2 x CP (load-balanced causal split)",
                   f"parallel.context={divisor_near(max(1, model.seq_length // 2), p.context)}")
        c.need(lay.transformer_engine, "parallel.context", p.context,
               "context parallelism needs Transformer Engine attention (GPU only)", "parallel.context=1")
    _validate_experts(c, p, model, lay)
    _validate_moe_overlap(c, job, lay)
    _validate_flex_dispatcher(c, job, lay)
    _validate_recompute_modules(c, job, lay)
    _validate_fsdp(c, job, lay)
    _validate_cuda_connections(c, job, lay)
    if p.sequence_parallel and p.tensor == 1:
        c.need(False, "parallel.sequence_parallel", True, "has no effect with parallel.tensor=1 (Megatron turns it off)",
               "parallel.sequence_parallel=false", severity="warning")
    c.need(p.first_stage_layers is None and p.last_stage_layers is None or p.pipeline > 1,
           "parallel.first_stage_layers" if p.first_stage_layers is not None else "parallel.last_stage_layers",
           p.first_stage_layers if p.first_stage_layers is not None else p.last_stage_layers,
           "an uneven split needs parallel.pipeline > 1",
           "parallel.first_stage_layers=null parallel.last_stage_layers=null")
    return c.problems


def _validate_tensor_widths(c: Checks, p: ParallelConfig, model: ModelConfig) -> None:
    """What TP shards must split evenly (TransformerConfig.__post_init__, attention.py, layers.py ``divide``)."""
    tp = p.tensor
    if model.num_attention_heads >= 1:
        c.need(model.num_attention_heads % tp == 0, "parallel.tensor", tp,
               f"must divide model.num_attention_heads={model.num_attention_heads}",
               f"parallel.tensor={divisor_near(model.num_attention_heads, tp)}")
    groups = model.num_query_groups or model.num_attention_heads
    if groups >= 1 and not model.multi_latent_attention:
        # Stricter than Megatron-Core, which also accepts a TP that is a multiple of the groups and replicates
        # KV heads: the planner's memory and the checkpoints assume KV heads are split over TP.
        c.need(groups % tp == 0, "parallel.tensor", tp,
               f"must divide the query groups model.num_query_groups={groups} (KV-head replication, which "
               "Megatron-Core allows when TP is a multiple of the groups, is not planned here)",
               f"parallel.tensor={divisor_near(groups, tp)}")
    if model.ffn_hidden_size >= 1:
        c.need(model.ffn_hidden_size % tp == 0, "parallel.tensor", tp,
               f"must divide model.ffn_hidden_size={model.ffn_hidden_size} (column-parallel MLP)",
               f"parallel.tensor={divisor_near(model.ffn_hidden_size, tp)}")


def _world_culprit(job: JobConfig, lay: Layout) -> str:
    """The size to name when TP x PP x CP does not divide the world: one that alone does not divide it
    (context first: it is the rarest to set), else the largest."""
    sizes = {"parallel.context": lay.cp, "parallel.pipeline": lay.pp, "parallel.tensor": lay.tp}
    for name, size in sizes.items():
        if lay.world % size:
            return name
    return max(sizes, key=sizes.get)


def _world_fix(job: JobConfig, lay: Layout) -> str:
    """Ways to make TP x PP x CP divide the world: the fewest nodes whose ranks it divides, or the size named
    by the rule (or the pipeline) moved to the nearest value that divides what the other two leave."""
    nodes = lay.model_parallel // math.gcd(lay.model_parallel, job.cluster.gpus_per_node)
    sizes = {"parallel.tensor": lay.tp, "parallel.pipeline": lay.pp, "parallel.context": lay.cp}
    culprit = _world_culprit(job, lay)
    hints = [f"nodes={nodes}"]
    for name in dict.fromkeys([culprit, "parallel.pipeline"]):
        others = lay.model_parallel // sizes[name]
        if lay.world % others == 0:
            hints.append(f"{name}={divisor_near(lay.world // others, sizes[name])}")
    return " or ".join(hints)


def _validate_overlap(c: Checks, p: ParallelConfig, lay: Layout) -> None:
    """Communication-overlap switches and what each one needs (Megatron-LM ``arguments.py`` asserts the first
    two at start-up; TE's userbuffers need the third)."""
    c.need(p.distributed_optimizer or not p.overlap_param_gather, "parallel.overlap_param_gather", True,
           "overlapping the parameter all-gather needs the distributed optimizer",
           "parallel.overlap_param_gather=false or parallel.distributed_optimizer=true")
    c.need(p.overlap_grad_reduce or not p.overlap_param_gather, "parallel.overlap_param_gather", True,
           "overlapping the parameter all-gather needs parallel.overlap_grad_reduce=true (Megatron-LM: "
           "'Must use --overlap-param-gather with --overlap-grad-reduce')",
           "parallel.overlap_grad_reduce=true or parallel.overlap_param_gather=false")
    if p.tp_comm_overlap:
        c.need(lay.sequence_parallel, "parallel.tp_comm_overlap", True,
               "TP communication overlap needs parallel.tensor > 1 and parallel.sequence_parallel=true",
               "parallel.tp_comm_overlap=false")
        c.need(lay.transformer_engine, "parallel.tp_comm_overlap", True,
               "TP communication overlap uses Transformer Engine userbuffers (GPU only)", "parallel.tp_comm_overlap=false")


def _validate_fsdp(c: Checks, job: JobConfig, lay: Layout) -> None:
    """parallel.megatron_fsdp: Megatron-FSDP shards the optimizer itself through the distributed optimizer (with
    Megatron's plain optimizer over its sharded parameters the gradient norm misses the shards of other ranks and
    training goes wrong: measured on CPU, DP2 loss 6.94 at step 4 instead of 6.74), and is planned and run here
    for PP = 1 only. On CPU it runs through models/cpu_compat.py's Megatron-FSDP bridges."""
    p, f = job.parallel, "parallel.megatron_fsdp"
    if not p.megatron_fsdp:
        return
    rules = [
        (p.distributed_optimizer, "needs parallel.distributed_optimizer=true (FSDP shards the optimizer state)"),
        (p.pipeline == 1, "is supported by this launcher with parallel.pipeline=1 only (NVIDIA's FSDP layouts)"),
    ]
    for ok, rule in rules:
        if not c.need(ok, f, True, rule, f"{f}=false"):
            return
    # The ranks write fsdp_dtensor with torch.distributed.checkpoint.save, synchronously (launcher/rank/
    # fsdp_checkpoint.py); checkpoint.async_save goes through Megatron-Core's torch_dist async writer only (the rank
    # wing refuses the combination too: launcher/rank/checkpoint/store.py check_options).
    c.need(not job.checkpoint.async_save, "checkpoint.async_save", True,
           "asynchronous saves write torch_dist only; under parallel.megatron_fsdp the ranks write the fsdp_dtensor "
           "format synchronously", "checkpoint.async_save=false")


def _validate_cuda_connections(c: Checks, job: JobConfig, lay: Layout) -> None:
    """CUDA_DEVICE_MAX_CONNECTIONS in cluster.env against the layout (Megatron-LM arguments.py validate_args):
    Megatron-FSDP needs more than one hardware queue (its all-gathers run beside compute); before Blackwell,
    TP/CP without FSDP or the MoE all-to-all overlap need exactly one, so TP/SP communication is issued before
    the GEMM it overlaps (tensor_parallel/layers.py relies on it)."""
    if job.cluster.gpu == "cpu":
        return
    # the value the ranks will see: cluster.env's, else the one derived from the job (launcher/core/cuda_env.py)
    value, f = max_connections(job), "cluster.env.CUDA_DEVICE_MAX_CONNECTIONS"
    if job.parallel.megatron_fsdp:
        c.need(value != "1", f, value, "Megatron-FSDP needs CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset "
               "(Megatron-LM refuses FSDP with 1)", f"{f}=8")
    elif (lay.tp > 1 or lay.cp > 1) and not job.parallel.moe_a2a_overlap and job.cluster.gpu in PRE_BLACKWELL:
        c.need(value == "1", f, value, f"tensor or context parallelism on {job.cluster.gpu} needs "
               "CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron-LM)", f"{f}=1")


def _validate_recompute_modules(c: Checks, job: JobConfig, lay: Layout) -> None:
    """train.recompute_modules as Megatron-Core checks them (transformer_config.py): known names, selective
    recompute only, mla_up_proj with MLA, moe_act with grouped GEMM, moe not with the all-to-all overlap."""
    mods, model, f = job.train.recompute_modules, job.model, "train.recompute_modules"
    if not mods:
        return
    from launcher.schema import RECOMPUTE_MODULES

    unknown = [m for m in mods if m not in RECOMPUTE_MODULES]

    def without(*drop) -> str:  # the job's modules less the offending ones: the smallest change that fixes it
        return f"{f}=[{','.join(m for m in mods if m not in set(drop) | set(unknown))}]"

    moe_norm = [m for m in mods if m in ("moe_act", "layernorm")]
    rules = [
        (not unknown, f"unknown module(s) {unknown}; known: {', '.join(RECOMPUTE_MODULES)}",
         respelled_list(f, mods, RECOMPUTE_MODULES) + without()),
        (job.train.recompute == Recompute.SELECTIVE, "apply to train.recompute=selective only",
         f"train.recompute=selective or {f}=[]"),
        ("mla_up_proj" not in mods or model.multi_latent_attention, "mla_up_proj needs model.multi_latent_attention",
         without("mla_up_proj")),
        ("moe_act" not in mods or (model.num_experts and model.moe_grouped_gemm), "moe_act needs an MoE model with "
         "model.moe_grouped_gemm=true", without("moe_act")),
        ("moe_act" not in mods or lay.transformer_engine, "moe_act needs the grouped-GEMM experts (GPU clusters only)",
         without("moe_act")),
        (not moe_norm or job.precision.fp8 != "delayed",
         "moe_act and layernorm recompute do not work with precision.fp8=delayed (use tensorwise or blockwise)",
         f"precision.fp8=tensorwise or {without(*moe_norm)}"),
        ("moe" not in mods or not job.parallel.moe_a2a_overlap, "moe cannot be recomputed with parallel.moe_a2a_overlap",
         f"{without('moe')} or parallel.moe_a2a_overlap=false"),
    ]
    for ok, rule, hint in rules:
        if not c.need(bool(ok), f, list(mods), rule, hint):
            return


def _validate_moe_overlap(c: Checks, job: JobConfig, lay: Layout) -> None:
    """Megatron-Core's overlap_moe_expert_parallel_comm asserts (transformer_config.py), stated up front."""
    p, model = job.parallel, job.model
    if not p.moe_a2a_overlap:
        return
    f = "parallel.moe_a2a_overlap"
    rules = [
        (bool(model.num_experts) and p.expert > 1, "needs an MoE model with parallel.expert > 1"),
        (lay.pp == 1 or lay.vpp > 1, "needs parallel.virtual_pipeline > 1 when parallel.pipeline > 1"),
        # transformer_config.py: "overlap_moe_expert_parallel_comm is supported with alltoall/flex token dispatcher"
        (model.moe_token_dispatcher_type in ("alltoall", "flex"), "needs model.moe_token_dispatcher_type=alltoall "
         "or flex"),
        (job.train.recompute != Recompute.FULL, "cannot be combined with train.recompute=full"),
        (job.precision.dtype in ("bf16", "fp16"), "needs precision.dtype bf16 or fp16"),
        ((model.mtp_num_layers or 0) <= 1, "supports at most one MTP layer (model.mtp_num_layers <= 1)"),
        (lay.transformer_engine, "runs on GPU streams with Transformer Engine layers (GPU clusters only)"),
    ]
    for ok, rule in rules:
        if not c.need(ok, f, True, rule, f"{f}=false"):
            return
    # The ranks write fsdp_dtensor with torch.distributed.checkpoint.save, synchronously (launcher/rank/
    # fsdp_checkpoint.py); checkpoint.async_save goes through Megatron-Core's torch_dist async writer only (the rank
    # wing refuses the combination too: launcher/rank/checkpoint/store.py check_options).
    c.need(not job.checkpoint.async_save, "checkpoint.async_save", True,
           "asynchronous saves write torch_dist only; under parallel.megatron_fsdp the ranks write the fsdp_dtensor "
           "format synchronously", "checkpoint.async_save=false")


def _validate_account_split(c: Checks, p: ParallelConfig, model: ModelConfig, vp: int) -> None:
    """Megatron-Core's account_for_embedding/loss_in_pipeline_split rules (transformer_config.py): not with the
    first/last stage overrides; layers + the counted modules divide PP, and each rank's share divides VPP."""
    name = ("parallel.account_for_embedding_in_pipeline_split" if p.account_for_embedding_in_pipeline_split
            else "parallel.account_for_loss_in_pipeline_split")
    if not c.need(p.first_stage_layers is None and p.last_stage_layers is None, name, True,
                  "cannot be combined with parallel.first_stage_layers/last_stage_layers (Megatron-Core refuses it)",
                  "parallel.first_stage_layers=null and parallel.last_stage_layers=null"):
        return
    if not c.need(p.pipeline > 1, name, True, "counting embedding/loss as layers needs parallel.pipeline > 1",
                  f"{name}=false"):
        return
    total = model.num_layers + p.account_for_embedding_in_pipeline_split + p.account_for_loss_in_pipeline_split
    chunks = p.pipeline * vp
    c.need(total % chunks == 0, name, True,
           f"model.num_layers={model.num_layers} + counted embedding/loss = {total} must be divisible by "
           f"parallel.pipeline x parallel.virtual_pipeline = {p.pipeline}x{vp} = {chunks}",
           f"parallel.pipeline={divisor_near(total // vp, p.pipeline) if total % vp == 0 else p.pipeline}"
           " or parallel.virtual_pipeline=null")


def _validate_pipeline_layout(c: Checks, p: ParallelConfig, model: ModelConfig) -> None:
    """parallel.pipeline_model_parallel_layout, as Megatron-Core's PipelineParallelLayerLayout checks it (plus
    the MTP placement our MTP block spec assumes: the last stage's last chunk)."""
    from launcher.core.layout import parse_pipeline_layout

    f, text = "parallel.pipeline_model_parallel_layout", p.pipeline_model_parallel_layout
    others = [n for n in ("first_stage_layers", "last_stage_layers") if getattr(p, n) is not None]
    others += [n for n in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
               if getattr(p, n)]
    if not c.need(not others, f, text, f"cannot be combined with parallel.{others[0] if others else ''} "
                  "(Megatron-Core refuses other split fields with a layout)", f"parallel.{others[0] if others else ''}=null"):
        return
    try:
        chunks = parse_pipeline_layout(text)
    except ValueError as exc:
        c.need(False, f, text, str(exc), f"{f}=null")
        return
    n, pp = len(chunks), p.pipeline
    if not c.need(n % pp == 0, f, text, f"has {n} virtual stages, not a multiple of parallel.pipeline={pp}", f"{f}=null"):
        return
    vp = n // pp
    c.need((p.virtual_pipeline or 1) == vp, "parallel.virtual_pipeline", p.virtual_pipeline,
           f"must equal the layout's virtual stages per rank ({n} / PP {pp} = {vp})",
           f"parallel.virtual_pipeline={vp if vp > 1 else 'null'}")
    flat = "".join(chunks)
    c.need(flat.count("E") == 1 and flat.startswith("E") and flat.count("L") == 1 and flat.endswith("L"), f, text,
           "must start with the embedding E and end with the loss L, each exactly once", f"{f}=null")
    c.need(flat.count("t") == model.num_layers, f, text,
           f"holds {flat.count('t')} decoder layers (t), model.num_layers={model.num_layers}", f"{f}=null")
    mtp = model.mtp_num_layers or 0
    ok = flat.count("m") == mtp and (not mtp or chunks[-1].count("m") == mtp)
    c.need(ok, f, text, f"must hold model.mtp_num_layers={mtp} MTP layers (m), all in the last virtual stage",
           f"{f}=null")


def _validate_layer_split(c: Checks, p: ParallelConfig, model: ModelConfig, lay: Layout) -> None:
    """transformer_config.py "Uneven PP" checks and parallel_state's "pipeline-model-parallel size should be
    greater than 1 with interleaved schedule"."""
    if p.virtual_pipeline is not None and p.virtual_pipeline < 1:
        return  # reported by validate_bounds
    vp = lay.vpp
    c.need(vp == 1 or p.pipeline > 1, "parallel.virtual_pipeline", vp,
           "virtual pipeline stages need parallel.pipeline > 1", "parallel.virtual_pipeline=null")
    if p.pipeline_model_parallel_layout is not None:
        _validate_pipeline_layout(c, p, model)
        return
    if p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split:
        _validate_account_split(c, p, model, vp)
        return
    layers = model.num_layers
    first, last = p.first_stage_layers, p.last_stage_layers
    if first is None and last is None:
        chunks = lay.pp * vp
        c.need(layers % chunks == 0, "model.num_layers", layers,
               f"must be divisible by parallel.pipeline x parallel.virtual_pipeline = {p.pipeline}x{vp} = {chunks} "
               "(or set parallel.first_stage_layers/last_stage_layers for an uneven split)",
               f"parallel.pipeline={divisor_near(max(1, layers // vp), p.pipeline)} or "
               f"model.num_layers={round_up(layers, chunks)}")
        return
    if (first is not None and first < 1) or (last is not None and last < 1):
        return  # reported by validate_bounds
    middle_stages = p.pipeline - (first is not None) - (last is not None)
    rest = layers - (first or 0) - (last or 0)
    for name, value in (("first_stage_layers", first), ("last_stage_layers", last)):
        if value is not None:
            c.need(value % vp == 0, f"parallel.{name}", value,
                   f"must be a multiple of parallel.virtual_pipeline={vp}", f"parallel.{name}={round_up(value, vp)}")
    if middle_stages <= 0:
        c.need(rest == 0, "parallel.first_stage_layers" if first is not None else "parallel.last_stage_layers",
               first if first is not None else last,
               f"with no middle stages, first + last stage layers must equal model.num_layers={layers}",
               f"parallel.last_stage_layers={layers - (first or 0)}" if first is not None and last is not None
               else "parallel.first_stage_layers=null parallel.last_stage_layers=null")
        return
    c.need(rest > 0 and rest % (middle_stages * vp) == 0,
           "parallel.first_stage_layers" if first is not None else "parallel.last_stage_layers",
           first if first is not None else last,
           f"the remaining {rest} of model.num_layers={layers} must split evenly over {middle_stages} middle "
           f"stages x parallel.virtual_pipeline={vp}", "parallel.first_stage_layers=null parallel.last_stage_layers=null")


def _validate_experts(c: Checks, p: ParallelConfig, model: ModelConfig, lay: Layout) -> None:
    per_stage = lay.world // lay.pp
    # parallel_state.py builds the expert groups for every model: "world_size is not divisible by
    # expert_tensor_model_pipeline_parallel size" (ETP x EP x PP).
    etp_named = p.expert_tensor is not None and per_stage % lay.etp != 0
    c.need(lay.expert_dp > 0 or not lay.dp, "parallel.expert_tensor" if etp_named else "parallel.expert",
           p.expert_tensor if etp_named else p.expert,
           f"parallel.expert_tensor x parallel.expert = {lay.etp}x{lay.ep} must divide the ranks per pipeline "
           f"stage ({per_stage})",
           f"parallel.expert_tensor={divisor_near(per_stage, lay.etp)}" if etp_named else
           f"parallel.expert={divisor_near(max(1, per_stage // lay.etp), lay.ep)}")
    if model.num_experts is None:
        # transformer_config.py: "num_moe_experts must be non None to use expert-parallel."
        c.need(p.expert == 1, "parallel.expert", p.expert, "expert parallelism needs an MoE model (model.num_experts)",
               "parallel.expert=1")
        return
    if model.num_experts < 1:
        return  # reported by validate_bounds
    # moe_layer.py: "assert self.config.num_moe_experts % ep_size == 0"
    c.need(model.num_experts % p.expert == 0, "parallel.expert", p.expert,
           f"must divide model.num_experts={model.num_experts}", f"parallel.expert={divisor_near(model.num_experts, p.expert)}")
    # moe_layer.py refuses MoE with TP but without SP ("... tensor parallelism ... sequence parallelism")
    c.need(p.tensor == 1 or p.sequence_parallel, "parallel.sequence_parallel", p.sequence_parallel,
           "an MoE model (model.num_experts) with tensor parallelism requires sequence parallelism",
           "parallel.sequence_parallel=true")
    expert_ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
    if expert_ffn >= 1:
        # experts are column/row-parallel over the expert-TP group (layers.py ``divide``)
        c.need(expert_ffn % lay.etp == 0, "parallel.expert_tensor" if p.expert_tensor else "parallel.tensor",
               lay.etp, f"expert tensor parallelism must divide the expert width "
               f"model.moe_ffn_hidden_size={expert_ffn}", f"model.moe_ffn_hidden_size={round_up(expert_ffn, lay.etp)}")
    shared = model.moe_shared_expert_intermediate_size
    if shared is not None and shared >= 1:
        c.need(shared % lay.tp == 0, "model.moe_shared_expert_intermediate_size", shared,
               f"the shared experts are tensor-parallel: must be divisible by parallel.tensor={lay.tp}",
               f"model.moe_shared_expert_intermediate_size={round_up(shared, lay.tp)}")
    # transformer_config.py: "Bias in Moe is only supported when ETP==1"
    c.need(not model.add_bias_linear or lay.etp == 1, "model.add_bias_linear", True,
           f"MoE with linear biases needs expert tensor parallelism 1 (parallel.expert_tensor is {lay.etp})",
           "parallel.expert_tensor=1 or model.add_bias_linear=false")
