"""Validate a composed job, section by section, before anything is written or submitted.

Each check returns Problems (field, value, rule, alternative); ``validate`` runs them all so that every
failure is reported at once. The rules mirror Megatron-Core's own asserts (parallel_state, TransformerConfig,
the pipeline schedules, Megatron-LM's ``megatron/training/arguments.py``) so that a job that passes here does
not die at step 0 on 512 GPUs. Allowed values are declared once, on the schema's fields (``choice``), and
checked by one generic rule; the cross-rules read the job's derived ``Layout`` (``launcher.core.derive``),
which never raises, so nothing here divides by a size the user set to 0.

Login-node code: no torch, no megatron.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from functools import lru_cache
from typing import Any, Callable, Iterator

from launcher.core import Layout, derive
from launcher.core.blend import is_number, parse_blend
from launcher.problems import Problem, errors
from launcher.schema import (SECTIONS, CheckpointConfig, DataConfig, JobConfig, LoggingConfig, ModelConfig,
                             ParallelConfig)

HOPPER_OR_NEWER = ("H100", "H200", "GH200", "B200", "GB200")
BLACKWELL = ("B200", "GB200")
SBATCH_WORD = re.compile(r"[A-Za-z0-9_.,-]+")
SBATCH_PATH = re.compile(r"[A-Za-z0-9_./+:@=-]+")
SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)
MAX_LAYERS = 100_000
"""Deeper than any published decoder (a few hundred layers): a larger value is a typo."""
MAX_PIPELINE = 1024
"""Pipeline and virtual-pipeline sizes above this are typos; the layout's per-chunk table has PP x VPP entries."""


class _Checks:
    """Collects problems; ``need(cond, ...)`` records one when cond is false."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def need(self, cond: bool, field: str, value, rule: str, hint: str, severity: str = "error") -> bool:
        if not cond:
            self.problems.append(Problem(field, value, rule, hint, severity))
        return bool(cond)

    def positive(self, field: str, value) -> bool:
        return self.need(value is not None and value >= 1, field, value, "must be a positive integer",
                         f"{field}=1")


# ---------------------------------------------------------------------------------------------- choices
def _choice_fields(job: JobConfig) -> Iterator[tuple[str, Any, dataclasses.Field]]:
    """(dotted name, section object, field) of every schema field declared with ``choice(...)``."""
    for prefix, section in (("", job), *((f"{name}.", getattr(job, name)) for name in SECTIONS)):
        for f in dataclasses.fields(section):
            if "choices" in f.metadata:
                yield prefix + f.name, section, f


def _allowed(section, name: str) -> bool:
    """The value of ``section.name`` is one the schema allows (so rules that branch on it may read it)."""
    f = section.__dataclass_fields__[name]
    value = getattr(section, name)
    return value in f.metadata["choices"] or (value is None and f.metadata["nullable"])


def validate_choices(job: JobConfig) -> list[Problem]:
    """Every choice field holds one of the values its schema declaration allows (null where nullable)."""
    problems = []
    for name, section, f in _choice_fields(job):
        if not _allowed(section, f.name):
            value, allowed = getattr(section, f.name), f.metadata["choices"]
            shown = ", ".join(map(str, allowed)) + (" (or null)" if f.metadata["nullable"] else "")
            problems.append(Problem(name, value, f"must be one of {shown}", f"{name}={_closest(value, allowed)}"))
    return problems


def _closest(value, allowed: tuple) -> str:
    """The allowed value nearest to a misspelt one (``1F1B`` -> ``1f1b``), else the first allowed value."""
    names = [str(a) for a in allowed]
    folded = {n.lower(): n for n in names}
    if str(value).lower() in folded:
        return folded[str(value).lower()]
    near = difflib.get_close_matches(str(value), names, n=1, cutoff=0.75)
    return near[0] if near else names[0]


# ------------------------------------------------------------------------------------------------ model
def validate_model(model: ModelConfig) -> list[Problem]:
    c = _Checks()
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
                 "seq_length"):
        c.positive(f"model.{name}", getattr(model, name))
    heads = model.num_attention_heads or 1
    if model.kv_channels is None and not model.multi_latent_attention and model.hidden_size:
        c.need(model.hidden_size % heads == 0, "model.num_attention_heads", heads,
               f"must divide hidden_size={model.hidden_size} (or set model.kv_channels)",
               f"model.kv_channels={max(1, model.hidden_size // heads)}")
    if model.num_query_groups is not None:
        c.need(model.num_query_groups >= 1 and heads % model.num_query_groups == 0,
               "model.num_query_groups", model.num_query_groups,
               f"must divide num_attention_heads={heads}", f"model.num_query_groups={_divisor_near(heads, 8)}")
    max_pos = model.max_position_embeddings
    if max_pos is not None:
        c.need(model.seq_length <= max_pos, "model.seq_length", model.seq_length,
               f"must not exceed max_position_embeddings={max_pos}", f"model.seq_length={max_pos}")
    c.need(0.0 < model.rotary_percent <= 1.0, "model.rotary_percent", model.rotary_percent,
           "must be in (0, 1]", "model.rotary_percent=1.0")
    c.need(0.0 <= model.attention_dropout < 1.0 and 0.0 <= model.hidden_dropout < 1.0,
           "model.hidden_dropout", model.hidden_dropout, "dropouts must be in [0, 1)", "model.hidden_dropout=0.0")
    c.need(model.mtp_num_layers >= 0, "model.mtp_num_layers", model.mtp_num_layers, "must be >= 0",
           "model.mtp_num_layers=0")
    if model.num_experts is not None:
        _validate_moe(c, model)
    if model.multi_latent_attention:
        c.need(model.position_embedding == "rope", "model.position_embedding", model.position_embedding,
               "multi-latent attention uses decoupled RoPE", "model.position_embedding=rope")
    return c.problems


def _validate_moe(c: _Checks, model: ModelConfig) -> None:
    if not c.positive("model.num_experts", model.num_experts):
        return
    c.need(1 <= model.moe_router_topk <= model.num_experts, "model.moe_router_topk", model.moe_router_topk,
           f"must be between 1 and num_experts={model.num_experts}", "model.moe_router_topk=2")
    c.need(0 <= model.moe_first_k_dense < model.num_layers, "model.moe_first_k_dense", model.moe_first_k_dense,
           f"must leave at least one MoE layer of num_layers={model.num_layers}", "model.moe_first_k_dense=0")
    c.positive("model.moe_layer_freq", model.moe_layer_freq)


# --------------------------------------------------------------------------------------------- parallel
def validate_parallel(job: JobConfig, lay: Layout) -> list[Problem]:
    c = _Checks()
    p, model, cluster = job.parallel, job.model, job.cluster
    sizes_ok = all([c.positive(f"parallel.{n}", getattr(p, n)) for n in ("tensor", "pipeline", "context", "expert")])
    # Without a positive world (nodes / cluster.gpus_per_node, reported by their own sections) no layout rule
    # can be stated.
    if p.expert_tensor is not None:
        sizes_ok = c.positive("parallel.expert_tensor", p.expert_tensor) and sizes_ok
    if not sizes_ok or min(job.nodes, cluster.gpus_per_node) < 1:
        return c.problems
    world, mp = lay.world, lay.model_parallel
    if c.need(lay.dp > 0, "parallel.tensor", p.tensor,
              f"TP x PP x CP = {p.tensor}x{p.pipeline}x{p.context} = {mp} must divide the world size "
              f"{job.nodes} nodes x {cluster.gpus_per_node} = {world}", _world_fix(job, lay)):
        if p.data is not None:
            c.need(p.data == lay.dp, "parallel.data", p.data,
                   f"is derived: world {world} / (TP x PP x CP = {mp}) = {lay.dp}", f"parallel.data={lay.dp} (or null)")
    c.need(p.tensor <= cluster.gpus_per_node, "parallel.tensor", p.tensor,
           f"tensor parallelism must stay inside one node ({cluster.gpus_per_node} GPUs per node)",
           f"parallel.tensor={cluster.gpus_per_node}")
    c.need(model.num_attention_heads % p.tensor == 0, "parallel.tensor", p.tensor,
           f"must divide model.num_attention_heads={model.num_attention_heads}",
           f"parallel.tensor={_divisor_near(model.num_attention_heads, p.tensor)}")
    groups = model.num_query_groups or model.num_attention_heads
    c.need(groups % p.tensor == 0, "parallel.tensor", p.tensor,
           f"must divide the query groups (GQA kv heads) model.num_query_groups={groups}",
           f"parallel.tensor={_divisor_near(groups, p.tensor)}")
    c.need(model.ffn_hidden_size % p.tensor == 0, "parallel.tensor", p.tensor,
           f"must divide model.ffn_hidden_size={model.ffn_hidden_size} (column-parallel MLP)",
           f"parallel.tensor={_divisor_near(model.ffn_hidden_size, p.tensor)}")
    if lay.sequence_parallel:
        shards = lay.tp * (2 * lay.cp if lay.cp > 1 else 1)
        c.need(model.seq_length % shards == 0, "parallel.sequence_parallel", True,
               f"model.seq_length={model.seq_length} must be divisible by TP{' x 2CP' if lay.cp > 1 else ''} = {shards}",
               f"model.seq_length={_round_up(model.seq_length, shards)}")
    _validate_overlap(c, p, lay)
    _validate_layer_split(c, p, model, lay)
    if p.context > 1:
        c.need(model.seq_length % (2 * p.context) == 0, "parallel.context", p.context,
               f"model.seq_length={model.seq_length} must be divisible by 2 x CP (load-balanced causal split)",
               f"parallel.context={_divisor_near(model.seq_length // 2, p.context)}")
        c.need(lay.transformer_engine, "parallel.context", p.context,
               "context parallelism needs Transformer Engine attention (GPU only)", "parallel.context=1")
    _validate_experts(c, p, model, lay)
    if p.sequence_parallel and p.tensor == 1:
        c.need(False, "parallel.sequence_parallel", True, "has no effect with parallel.tensor=1 (Megatron turns it off)",
               "parallel.sequence_parallel=false", severity="warning")
    c.need(p.first_stage_layers is None and p.last_stage_layers is None or p.pipeline > 1,
           "parallel.first_stage_layers", p.first_stage_layers, "an uneven split needs parallel.pipeline > 1",
           "parallel.first_stage_layers=null")
    return c.problems


def _world_fix(job: JobConfig, lay: Layout) -> str:
    """Two ways to make TP x PP x CP divide the world: the fewest nodes whose ranks it divides, or the
    pipeline size nearest to the current one that divides the ranks TP x CP leave."""
    nodes = lay.model_parallel // math.gcd(lay.model_parallel, job.cluster.gpus_per_node)
    return f"nodes={nodes} or parallel.pipeline={_divisor_near(lay.world // (lay.tp * lay.cp), lay.pp)}"


def _validate_overlap(c: _Checks, p: ParallelConfig, lay: Layout) -> None:
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


def _validate_account_split(c: _Checks, p: ParallelConfig, model: ModelConfig, vp: int) -> None:
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
           f"parallel.pipeline={_divisor_near(total // vp, p.pipeline) if total % vp == 0 else p.pipeline}"
           " or parallel.virtual_pipeline=null")


def _validate_pipeline_layout(c: _Checks, p: ParallelConfig, model: ModelConfig) -> None:
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


def _validate_layer_split(c: _Checks, p: ParallelConfig, model: ModelConfig, lay: Layout) -> None:
    if p.virtual_pipeline is not None and not c.positive("parallel.virtual_pipeline", p.virtual_pipeline):
        return
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
               f"must be divisible by PP x VPP = {p.pipeline}x{vp} = {chunks} "
               "(or set parallel.first_stage_layers/last_stage_layers for an uneven split)",
               f"parallel.pipeline={_divisor_near(layers, p.pipeline)}")
        return
    middle_stages = p.pipeline - (first is not None) - (last is not None)
    rest = layers - (first or 0) - (last or 0)
    for name, value in (("first_stage_layers", first), ("last_stage_layers", last)):
        if value is not None:
            c.need(value >= 1 and value % vp == 0, f"parallel.{name}", value,
                   f"must be a positive multiple of the virtual pipeline size {vp}", f"parallel.{name}={vp}")
    if middle_stages <= 0:
        c.need(rest == 0, "parallel.first_stage_layers", first,
               f"first + last stage layers must equal model.num_layers={layers}", f"parallel.last_stage_layers={layers - (first or 0)}")
        return
    c.need(rest > 0 and rest % (middle_stages * vp) == 0, "parallel.first_stage_layers", first,
           f"the remaining {rest} layers must split evenly over {middle_stages} middle stages x VPP {vp}",
           "parallel.first_stage_layers=null and parallel.last_stage_layers=null")


def _validate_experts(c: _Checks, p: ParallelConfig, model: ModelConfig, lay: Layout) -> None:
    if model.num_experts is None:
        c.need(p.expert == 1, "parallel.expert", p.expert, "expert parallelism needs an MoE model (model.num_experts)",
               "parallel.expert=1")
        return
    c.need(model.num_experts % p.expert == 0, "parallel.expert", p.expert,
           f"must divide model.num_experts={model.num_experts}", f"parallel.expert={_divisor_near(model.num_experts, p.expert)}")
    # Expert DP = world / (ETP x EP x PP) is 0 exactly when ETP x EP does not divide the ranks of a stage.
    c.need(lay.expert_dp > 0, "parallel.expert", p.expert,
           f"ETP x EP = {lay.etp}x{lay.ep} must divide the ranks per pipeline stage ({lay.world // lay.pp})",
           "parallel.expert=1")
    c.need(p.tensor == 1 or p.sequence_parallel, "parallel.sequence_parallel", p.sequence_parallel,
           "MoE with tensor parallelism requires sequence parallelism", "parallel.sequence_parallel=true")


# --------------------------------------------------------------------------------------------- schedule
def validate_schedule(job: JobConfig, lay: Layout) -> list[Problem]:
    c = _Checks()
    s, p = job.schedule, job.parallel
    if not _allowed(s, "kind"):
        return c.problems  # reported by validate_choices
    vp, m = lay.vpp, lay.microbatches
    if s.kind == "zb_h1" and job.action not in ("plan", "search", "validate"):
        c.need(False, "schedule.kind", s.kind, "zero-bubble is planned and simulated (action=plan) but cannot "
               "train yet: its schedule lands with the zero-bubble issue", "schedule.kind=1f1b")
    if s.kind == "interleaved":
        c.need(vp > 1 and p.pipeline > 1, "schedule.kind", s.kind,
               "interleaved needs parallel.pipeline > 1 and parallel.virtual_pipeline > 1",
               "parallel.virtual_pipeline=2 (or schedule.kind=1f1b)")
        c.need(not (p.pipeline == 2 and s.batch_p2p_comm and not s.overlap_p2p_comm), "schedule.batch_p2p_comm",
               s.batch_p2p_comm, "interleaved with PP=2 and batched p2p trains silently wrong (Megatron-LM #750, #1450)",
               "schedule.batch_p2p_comm=false or schedule.overlap_p2p_comm=true")
        group = lay.microbatch_group
        if m:
            c.need(m % group == 0, "train.global_batch_size", job.train.global_batch_size,
                   f"interleaved needs microbatches per step ({m}) divisible by the microbatch group size ({group})",
                   f"train.global_batch_size={_round_up(m, group) * job.train.global_batch_size // m}")
    else:
        c.need(vp == 1, "parallel.virtual_pipeline", p.virtual_pipeline,
               f"virtual pipeline stages need schedule.kind=interleaved (got {s.kind})", "schedule.kind=interleaved")
        c.need(not s.overlap_p2p_comm, "schedule.overlap_p2p_comm", True,
               "p2p overlap is implemented only for the interleaved schedule", "schedule.overlap_p2p_comm=false")
    if s.microbatch_group_size is not None:
        c.need(s.microbatch_group_size >= p.pipeline, "schedule.microbatch_group_size", s.microbatch_group_size,
               f"must be at least parallel.pipeline={p.pipeline}", f"schedule.microbatch_group_size={p.pipeline}")
    if p.pipeline > 1 and m:
        c.need(m >= p.pipeline, "train.global_batch_size", job.train.global_batch_size,
               f"only {m} microbatches for {p.pipeline} pipeline stages: the pipeline never fills (bubble > 50%)",
               f"train.global_batch_size={p.pipeline * job.train.global_batch_size // m}", severity="warning")
    return c.problems


# -------------------------------------------------------------------------------------------- precision
def validate_precision(job: JobConfig, lay: Layout) -> list[Problem]:
    c = _Checks()
    pr, cluster = job.precision, job.cluster
    te = lay.transformer_engine
    c.need(not (te and cluster.gpu == "cpu"), "precision.transformer_engine", pr.transformer_engine,
           "Transformer Engine needs a GPU (this cluster profile is cpu)", "precision.transformer_engine=false")
    if pr.fp8 is not None:
        if _allowed(pr, "fp8"):
            needs = BLACKWELL if pr.fp8 == "mxfp8" else HOPPER_OR_NEWER
            generation = "Blackwell (B200)" if pr.fp8 == "mxfp8" else "Hopper or newer (H100/H200/B200)"
            c.need(cluster.gpu in needs, "precision.fp8", pr.fp8,
                   f"this FP8 recipe needs {generation}; cluster.gpu is {cluster.gpu}",
                   "precision.fp8=null" if cluster.gpu not in HOPPER_OR_NEWER else "precision.fp8=delayed")
        c.need(te, "precision.fp8", pr.fp8, "FP8 needs Transformer Engine layers",
               "precision.fp8=null or precision.transformer_engine=auto on a GPU cluster")
        c.need(pr.dtype in ("bf16", "fp16"), "precision.dtype", pr.dtype, "FP8 training runs on a bf16/fp16 model",
               "precision.dtype=bf16")
    c.need(te or not job.model.multi_latent_attention, "model.multi_latent_attention", True,
           "multi-latent attention needs Transformer Engine attention (Megatron-Core's local attention cannot "
           "take MLA's head sizes)", "a GPU cluster profile (cluster=h100) or model.multi_latent_attention=false")
    c.need(not pr.fp8_param or pr.fp8 is not None, "precision.fp8_param", pr.fp8_param,
           "FP8 parameters need an FP8 recipe", "precision.fp8=delayed or precision.fp8_param=false")
    # Megatron-LM arguments.py: "--fp8-param-gather only supported with distributed optimizer" (the rank wing
    # maps fp8_param to fp8_param_gather); without it the FP8 weights would never be updated.
    c.need(not pr.fp8_param or job.parallel.distributed_optimizer, "precision.fp8_param", pr.fp8_param,
           "FP8 parameters are re-quantised by the distributed optimizer under fp8_param_gather; Megatron-LM "
           "asserts FP8 param gather needs the distributed optimizer",
           "parallel.distributed_optimizer=true or precision.fp8_param=false")
    return c.problems


# ------------------------------------------------------------------------------------------------ train
def validate_train(job: JobConfig, lay: Layout) -> list[Problem]:
    c = _Checks()
    t = job.train
    c.positive("train.micro_batch_size", t.micro_batch_size)
    c.positive("train.global_batch_size", t.global_batch_size)
    dp = lay.dp
    if dp and t.micro_batch_size >= 1:
        unit = t.micro_batch_size * dp
        c.need(t.global_batch_size % unit == 0, "train.global_batch_size", t.global_batch_size,
               f"must be divisible by micro_batch_size x DP = {t.micro_batch_size}x{dp} = {unit}",
               f"train.global_batch_size={_round_up(max(t.global_batch_size, unit), unit)}")
    c.need((t.train_steps is None) != (t.train_tokens is None), "train.train_steps", t.train_steps,
           "set exactly one of train.train_steps and train.train_tokens", "train.train_tokens=null")
    if t.train_steps is not None:
        c.positive("train.train_steps", t.train_steps)
        c.need(t.warmup_steps < t.train_steps or t.train_steps < 1, "train.warmup_steps", t.warmup_steps,
               f"must be shorter than train.train_steps={t.train_steps}", f"train.warmup_steps={t.train_steps // 10}")
    if t.train_tokens is not None:
        c.positive("train.train_tokens", t.train_tokens)
    c.need(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, "must be >= 0", "train.warmup_steps=0")
    c.need(t.lr > 0, "train.lr", t.lr, "must be positive", "train.lr=3e-4")
    c.need(0 <= t.min_lr <= t.lr, "train.min_lr", t.min_lr, f"must be in [0, train.lr={t.lr}]", f"train.min_lr={t.lr / 10:g}")
    c.need(t.clip_grad >= 0, "train.clip_grad", t.clip_grad, "must be >= 0 (0 disables clipping)", "train.clip_grad=1.0")
    c.need(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "must be >= 0", "train.weight_decay=0.1")
    c.need(0 <= t.adam_beta1 < 1 and 0 <= t.adam_beta2 < 1, "train.adam_beta2", t.adam_beta2,
           "Adam betas must be in [0, 1)", "train.adam_beta2=0.95")
    if t.eval_interval:
        c.positive("train.eval_iters", t.eval_iters)
    c.need(t.eval_interval >= 0, "train.eval_interval", t.eval_interval, "must be >= 0 (0 disables)", "train.eval_interval=0")
    if t.wsd_decay_steps is not None and t.train_steps is not None:
        c.need(0 < t.wsd_decay_steps <= t.train_steps, "train.wsd_decay_steps", t.wsd_decay_steps,
               f"must be in (0, train.train_steps={t.train_steps}]", f"train.wsd_decay_steps={max(1, t.train_steps // 10)}")
    return c.problems


# ------------------------------------------------------------------------------------------------- data
def validate_data(data: DataConfig) -> list[Problem]:
    c = _Checks()
    if not _allowed(data, "kind"):
        return c.problems  # reported by validate_choices
    parts = [s.strip() for s in str(data.split).split(",")]
    c.need(len(parts) == 3 and all(is_number(s) and float(s) >= 0 for s in parts) and any(float(s) > 0 for s in parts if is_number(s)),
           "data.split", data.split, "must be three non-negative weights train,valid,test", "data.split=969,30,1")
    c.need(data.kind != "mock" or not data.blend, "data.kind", data.kind,
           "mock data ignores data.blend: a blend was given but would never be read", "data.kind=indexed")
    if data.kind == "indexed":
        c.need(len(data.blend) > 0, "data.blend", list(data.blend), "indexed data needs at least one dataset prefix",
               "data.blend=[path/to/prefix] or data=mock")
        c.need(bool(data.tokenizer), "data.tokenizer", data.tokenizer, "indexed data needs a tokenizer.json path",
               "data.tokenizer=data/assets/tokenizer.json")
        problem = blend_structure_problem(list(data.blend))
        if problem:
            c.problems.append(problem)
    c.need(data.num_workers >= 0, "data.num_workers", data.num_workers, "must be >= 0", "data.num_workers=1")
    return c.problems


def blend_structure_problem(blend: list) -> Problem | None:
    try:
        pairs = parse_blend(blend)
    except ValueError:
        return Problem("data.blend", blend, "must be [prefix, ...] or [weight, prefix, weight, prefix, ...]",
                       "data.blend=[0.3,path/a,0.7,path/b]")
    bad = [w for w, _ in pairs if w <= 0]
    if bad:
        return Problem("data.blend", blend, f"weights must be positive (got {bad[0]:g})",
                       "remove the dataset from the blend or give it a positive weight")
    return None


# ---------------------------------------------------------------------------------------- run, cluster
def validate_checkpoint(ckpt: CheckpointConfig) -> list[Problem]:
    c = _Checks()
    c.need(ckpt.save_interval >= 0, "checkpoint.save_interval", ckpt.save_interval, "must be >= 0 (0: only at the end)",
           "checkpoint.save_interval=1000")
    c.need(not ckpt.async_save, "checkpoint.async_save", True,
           "asynchronous saving is not implemented yet: checkpoints are written synchronously",
           "checkpoint.async_save=false", severity="warning")
    if ckpt.keep_last is not None:
        c.positive("checkpoint.keep_last", ckpt.keep_last)
    return c.problems


def validate_logging(logging: LoggingConfig) -> list[Problem]:
    c = _Checks()
    c.positive("logging.log_interval", logging.log_interval)
    return c.problems


def validate_cluster(job: JobConfig) -> list[Problem]:
    c = _Checks()
    cl = job.cluster
    c.positive("cluster.gpus_per_node", cl.gpus_per_node)
    c.need(not (cl.gpu == "cpu" and cl.backend == "nccl"), "cluster.backend", cl.backend,
           "NCCL needs GPUs; a cpu cluster uses gloo", "cluster.backend=gloo")
    c.need(cl.launcher != "local" or job.nodes == 1, "nodes", job.nodes,
           "a local cluster runs on this one machine", "nodes=1 (or cluster=h200 to submit with Slurm)")
    c.need(job.action != "run" or cl.launcher == "local", "action", job.action,
           f"action=run starts torchrun on this machine; cluster {cl.name} launches through Slurm",
           "action=submit (or cluster=local)")
    c.need(job.action != "submit" or cl.launcher == "slurm", "action", job.action,
           f"action=submit needs a Slurm cluster profile; cluster {cl.name} runs locally",
           "action=run (or a Slurm profile such as cluster=h200)")
    for name, value in cl.env.items():
        c.need(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(name)) is not None, f"cluster.env.{name}", value,
               "environment variable names are letters, digits and _", "cluster.env.MY_VAR=value")
        c.need(not SECRET_NAME.search(str(name)), f"cluster.env.{name}", "<redacted>",
               "secrets are never written into a run bundle", f"export {name} in your shell and add it to cluster.secret_env")
    for name in cl.secret_env:
        c.need(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(name)) is not None, "cluster.secret_env", name,
               "must list environment variable names", "cluster.secret_env=[WANDB_API_KEY]")
    for mount in cl.container_mounts:
        c.need(":" in str(mount) and all(str(mount).split(":")[:2]), "cluster.container_mounts", mount,
               "each mount is src:dst", "cluster.container_mounts=[/lustre:/lustre]")
    if cl.container_image:
        _validate_paths_in_mounts(c, job)
    return c.problems


def _validate_paths_in_mounts(c: _Checks, job: JobConfig) -> None:
    """With a container, every path the job reads or writes must be visible inside it (under a mount dst)."""
    dsts = [str(m).split(":")[1].rstrip("/") for m in job.cluster.container_mounts if ":" in str(m)]
    paths: list[tuple[str, str]] = [("output_dir", job.output_dir)]
    if job.checkpoint.dir:
        paths.append(("checkpoint.dir", job.checkpoint.dir))
    if job.data.kind == "indexed":
        if job.data.tokenizer:
            paths.append(("data.tokenizer", job.data.tokenizer))
        try:
            paths += [("data.blend", prefix) for _, prefix in parse_blend(list(job.data.blend))]
        except ValueError:
            pass
    if job.data.cache_dir:
        paths.append(("data.cache_dir", job.data.cache_dir))
    for field, path in paths:
        c.need(path.startswith("/") and any(path == d or path.startswith(d + "/") for d in dsts), field, path,
               f"must be an absolute path inside a container mount ({', '.join(dsts) or 'none'})",
               f"cluster.container_mounts=[{path.rsplit('/', 1)[0] or '/'}:{path.rsplit('/', 1)[0] or '/'}]")


def validate_slurm(job: JobConfig) -> list[Problem]:
    c = _Checks()
    s = job.slurm
    seconds = _slurm_seconds(s.time)
    c.need(seconds is not None, "slurm.time", s.time, "must be [D-]HH:MM:SS", "slurm.time=04:00:00")
    if seconds is not None:
        c.need(0 <= s.signal_lead_s < seconds, "slurm.signal_lead_s", s.signal_lead_s,
               f"must be shorter than the time limit ({seconds} s)", f"slurm.signal_lead_s={seconds // 10}")
        # slurmctld checks time limits every ~30 s, so USR1 can come that much earlier than asked; a lead that
        # close to the limit makes every requeued run stop as soon as it starts.
        if 0 <= s.signal_lead_s < seconds:
            c.need(s.signal_lead_s + 60 <= seconds, "slurm.signal_lead_s", s.signal_lead_s,
                   f"leaves under 60 s of the {seconds} s limit before the stop signal (Slurm may signal ~30 s early)",
                   f"slurm.signal_lead_s={max(0, seconds // 10)}", severity="warning")
    # #SBATCH lines are read by sbatch, not by a shell, so quoting cannot protect them: restrict their values.
    for name, value in (("cluster.partition", job.cluster.partition), ("cluster.account", job.cluster.account),
                        ("slurm.job_name", s.job_name)):
        if value is not None:
            c.need(SBATCH_WORD.fullmatch(str(value)) is not None, name, value,
                   "Slurm names are letters, digits, '.', ',', '_' and '-'", f"{name}=batch")
    if job.cluster.launcher == "slurm":
        bundle_parent = os.path.abspath(job.output_dir)  # relative output_dir resolves against the cwd
        c.need(SBATCH_PATH.fullmatch(bundle_parent) is not None, "output_dir", bundle_parent,
               "the bundle path appears in #SBATCH --output: no spaces, quotes, '%' or shell characters",
               "output_dir=/lustre/$USER/runs (spelled out)")
    for arg in s.extra_args:
        c.need(str(arg).startswith("--") and "\n" not in str(arg), "slurm.extra_args", arg,
               "each entry is one long sbatch option", "slurm.extra_args=[--qos=high]")
    return c.problems


def validate_job(job: JobConfig) -> list[Problem]:
    c = _Checks()
    c.positive("nodes", job.nodes)
    c.need(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", job.name or "") is not None, "name", job.name,
           "run names are letters, digits, '.', '_' and '-'", "name=my_run")
    return c.problems


def validate_sizes(job: JobConfig) -> list[Problem]:
    """Sizes so large that they can only be typos; checked before anything is derived, because the layout
    holds a table per layer and per (virtual) pipeline chunk."""
    c = _Checks()
    for name, value, most in (("model.num_layers", job.model.num_layers, MAX_LAYERS),
                              ("parallel.pipeline", job.parallel.pipeline, MAX_PIPELINE),
                              ("parallel.virtual_pipeline", job.parallel.virtual_pipeline, MAX_PIPELINE)):
        c.need(value is None or value <= most, name, value, f"must be at most {most} (a typo?)", f"{name}=1")
    return c.problems


SECTION_CHECKS: tuple[Callable[[JobConfig, Layout], list[Problem]], ...] = (
    lambda j, lay: validate_job(j),
    lambda j, lay: validate_choices(j),
    lambda j, lay: validate_model(j.model),
    lambda j, lay: validate_cluster(j),
    validate_parallel,
    validate_schedule,
    validate_precision,
    validate_train,
    lambda j, lay: validate_data(j.data),
    lambda j, lay: validate_checkpoint(j.checkpoint),
    lambda j, lay: validate_logging(j.logging),
    lambda j, lay: validate_slurm(j),
)
"""Each section's rules, in report order; the cross-section ones read the derived layout."""


def validate(job: JobConfig) -> list[Problem]:
    """Every problem of every section (errors and warnings), in section order."""
    problems = validate_sizes(job)
    if errors(problems):
        return problems
    lay = derive(job)
    for check in SECTION_CHECKS:
        problems.extend(check(job, lay))
    return problems


# -------------------------------------------------------------------------------------------- helpers
@lru_cache(maxsize=4096)
def _divisor_near(n: int, want: int) -> int:
    """The divisor of n closest to want (ties go lower): a valid value to suggest."""
    n = max(1, int(n))
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]  # O(sqrt n): hints are built eagerly
    divisors = small + [n // d for d in small]
    return min(divisors, key=lambda d: (abs(d - want), d))


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit if unit else x


def _slurm_seconds(text: str) -> int | None:
    m = re.fullmatch(r"(?:(\d+)-)?(\d{1,2}):(\d{2}):(\d{2})", str(text))
    if not m:
        return None
    days, h, mi, s = (int(g or 0) for g in m.groups())
    return ((days * 24 + h) * 60 + mi) * 60 + s
