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

import copy
import dataclasses
import difflib
import math
import os
import re
from functools import lru_cache
from typing import Any, Callable, Iterator

from launcher import ROOT
from launcher.core import Layout, derive
from launcher.core.blend import is_number, parse_blend
from launcher.core.cuda_env import PRE_BLACKWELL, max_connections
from launcher.problems import Problem, errors
from launcher.schema import (SECTIONS, CheckpointConfig, DataConfig, JobConfig, LoggingConfig, ModelConfig,
                             ParallelConfig)

HOPPER_OR_NEWER = ("H100", "H200", "GH200", "B200", "GB200")
BLACKWELL = ("B200", "GB200")
SBATCH_WORD = re.compile(r"[A-Za-z0-9_.,-]+")
SBATCH_PATH = re.compile(r"[A-Za-z0-9_./+:@=-]+")
WANDB_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
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


# ----------------------------------------------------------------------------------------------- bounds
@dataclasses.dataclass(frozen=True)
class Bound:
    """The range of one numeric field: ``lo <= value`` (``lo < value`` when lo_open), likewise for hi."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""

    def holds(self, value) -> bool:
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def describe(self, integer: bool) -> str:
        if integer and self.lo == 1 and self.hi is None:
            text = "a positive integer"
        elif integer and self.lo == 0 and self.hi is None:
            text = "an integer >= 0"
        elif self.hi is None:
            text = f"{'an integer' if integer else 'a number'} {'>' if self.lo_open else '>='} {_num(self.lo)}"
        else:
            text = (f"{'an integer' if integer else 'a number'} in {'(' if self.lo_open else '['}{_num(self.lo)}, "
                    f"{_num(self.hi)}{')' if self.hi_open else ']'}")
        return text + (f" ({self.why})" if self.why else "")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


POSITIVE, NON_NEGATIVE, FRACTION = Bound(1), Bound(0), Bound(0, 1, lo_open=True)
POSITIVE_NUMBER, PROBABILITY = Bound(0, lo_open=True), Bound(0, 1, hi_open=True)
BOUNDS: dict[str, Bound] = {
    **{f"model.{n}": POSITIVE for n in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
        "vocab_size", "make_vocab_size_divisible_by", "seq_length", "max_position_embeddings", "num_experts",
        "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
        "qk_pos_emb_head_dim", "v_head_dim", "moe_router_num_groups", "moe_router_group_topk")},
    "model.moe_router_topk_scaling_factor": POSITIVE_NUMBER,
    # moe_utils.get_capacity: ceil(tokens x topk / experts x factor) experts' slots; 0 would drop every token
    "model.moe_expert_capacity_factor": Bound(0, lo_open=True, why="0 drops every token"),
    # transformer_config.py: "moe_shared_expert_intermediate_size must be num_shared_experts * ffn_size..."
    "model.moe_shared_expert_intermediate_size": POSITIVE,
    "model.norm_epsilon": POSITIVE_NUMBER, "model.rotary_base": POSITIVE_NUMBER, "model.rotary_percent": FRACTION,
    "model.rope_scaling_factor": POSITIVE_NUMBER, "model.attention_dropout": PROBABILITY,
    "model.hidden_dropout": PROBABILITY, "model.moe_first_k_dense": NON_NEGATIVE,
    "model.moe_aux_loss_coeff": Bound(0), "model.mtp_num_layers": NON_NEGATIVE,
    # torch.nn.init.normal_ refuses a negative std; 0 would start every weight equal (no symmetry breaking)
    "model.init_method_std": Bound(0, lo_open=True, why="0 starts every weight equal"),
    **{f"parallel.{n}": POSITIVE for n in ("tensor", "pipeline", "context", "expert", "virtual_pipeline",
                                           "expert_tensor", "data", "first_stage_layers", "last_stage_layers")},
    "schedule.microbatch_group_size": POSITIVE, "precision.fp8_amax_history_len": POSITIVE,
    **{f"train.{n}": POSITIVE for n in ("micro_batch_size", "global_batch_size", "train_steps", "train_tokens",
                                        "wsd_decay_steps", "eval_iters", "recompute_num_layers")},
    "train.warmup_steps": NON_NEGATIVE, "train.eval_interval": Bound(0, why="0 disables"),
    # torch.optim.Adam: "Invalid learning rate / epsilon / beta parameter / weight_decay value"
    "train.lr": POSITIVE_NUMBER, "train.min_lr": Bound(0), "train.weight_decay": Bound(0),
    "train.adam_beta1": PROBABILITY, "train.adam_beta2": PROBABILITY,
    "train.adam_eps": Bound(0, lo_open=True, why="Adam divides by sqrt(v) + eps"),
    "train.clip_grad": Bound(0, why="0 disables clipping"), "train.exit_after_minutes": POSITIVE_NUMBER,
    # torch.manual_seed takes 64 bits; the ranks offset the seed per layer (x 1000003) and per rank
    "train.seed": Bound(0, 2**31 - 1),
    "data.num_workers": NON_NEGATIVE, "checkpoint.save_interval": Bound(0, why="0: only at the end"),
    "checkpoint.keep_last": POSITIVE, "logging.log_interval": POSITIVE,
    "cluster.gpus_per_node": POSITIVE, "cluster.memory_reserve_gb": Bound(0),
    **{f"cluster.{n}": POSITIVE_NUMBER for n in ("gpu_memory_gb", "peak_tflops_bf16", "peak_tflops_fp8",
                                                 "hbm_bandwidth_gbps", "nvlink_bandwidth_gbps",
                                                 "network_bandwidth_gbps")},
    **{f"cluster.{n}": FRACTION for n in ("gemm_efficiency", "fp8_gemm_efficiency", "comm_efficiency",
                                         "network_efficiency")},
    "slurm.signal_lead_s": NON_NEGATIVE, "nodes": POSITIVE,
    # nothing lost, nothing hangs: requeue/restart budgets, the stop-in-time arithmetic, the straggler report
    "slurm.max_requeues": Bound(0, why="0: never requeue"),
    "cluster.max_restarts": Bound(0, why="torchrun --max-restarts; null: 3 on Slurm, 0 locally"),
    "slurm.signal_save_factor": Bound(1, why="the next save may be as slow as the last"),
    "slurm.signal_margin_s": NON_NEGATIVE, "cluster.checkpoint_write_gbps": POSITIVE_NUMBER,
    "train.straggler_interval": Bound(0, why="0 disables"),
    "train.straggler_margin": Bound(0, lo_open=True, why="relative to the median step time"),
    "profile.step_start": POSITIVE, "profile.step_end": POSITIVE, "profile.memory_snapshot_entries": POSITIVE,
}
"""Every numeric field's range, declared once: checked by ``validate_bounds`` and quoted when Hydra cannot
even convert a value (``field_rule``). Cross-field rules live in the sections below."""


def _get(job: JobConfig, name: str):
    section, _, attr = name.rpartition(".")
    return getattr(getattr(job, section) if section else job, attr)


def in_bounds(job: JobConfig, *names: str) -> bool:
    """All the named fields hold a usable value (set, and inside their declared range)."""
    for name in names:
        value = _get(job, name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if not (math.isfinite(value) and BOUNDS.get(name, Bound()).holds(value)):
            return False
    return True


def field_rule(name: str) -> str:
    """A field's type and range in words, e.g. ``a positive integer (or null)``."""
    kind = _FIELD_TYPES[name][1] if name in _FIELD_TYPES else ""
    nullable = " (or null)" if kind.startswith("Optional") else ""
    section, _, attr = name.rpartition(".")
    cls = SECTIONS[section] if section else JobConfig
    meta = cls.__dataclass_fields__[attr].metadata if attr in cls.__dataclass_fields__ else {}
    if "choices" in meta:
        return "one of " + ", ".join(map(str, meta["choices"])) + nullable
    integer = "int" in kind
    if name in BOUNDS:
        return BOUNDS[name].describe(integer) + nullable
    for word, text in (("bool", "true or false"), ("int", "an integer"), ("float", "a number"),
                       ("List", "a list such as [a,b]"), ("Dict", "a mapping"), ("str", "a string")):
        if word in kind:
            return text + nullable
    return "a value of the schema's type" + nullable


def validate_bounds(job: JobConfig) -> list[Problem]:
    """Every numeric field inside its declared range (``BOUNDS``); nulls are left to the rules that need a value."""
    c = _Checks()
    for name, bound in BOUNDS.items():
        value = _get(job, name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue  # null is allowed where the schema allows it; non-finite is reported by validate_finite
        integer = "int" in _FIELD_TYPES[name][1]
        c.need(bound.holds(value), name, value, f"must be {bound.describe(integer)}", f"{name}={_bound_hint(name, bound)}")
    return c.problems


def _bound_hint(name: str, bound: Bound) -> str:
    default = _default_text(name)
    if default not in (None, "null") and bound.holds(float(default)):
        return default
    return f"{bound.lo:g}" if bound.lo is not None and not bound.lo_open else "1"


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
    """Architecture rules (ranges are in ``BOUNDS``); TransformerConfig.__post_init__ and the layer modules
    of megatron/core/transformer are the upstream checks mirrored here."""
    c = _Checks()
    heads = model.num_attention_heads if model.num_attention_heads >= 1 else 1
    if model.kv_channels is None and not model.multi_latent_attention and model.hidden_size >= 1:
        # transformer_config.py: kv_channels = hidden_size // num_attention_heads
        c.need(model.hidden_size % heads == 0, "model.num_attention_heads", model.num_attention_heads,
               f"must divide model.hidden_size={model.hidden_size} (or set model.kv_channels)",
               f"model.num_attention_heads={_divisor_near(model.hidden_size, heads)}")
    if model.num_query_groups is not None and model.num_query_groups >= 1:
        c.need(heads % model.num_query_groups == 0, "model.num_query_groups", model.num_query_groups,
               f"must divide model.num_attention_heads={heads}", f"model.num_query_groups={_divisor_near(heads, 8)}")
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


def _validate_rope(c: _Checks, model: ModelConfig, heads: int) -> None:
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


def _validate_moe(c: _Checks, model: ModelConfig) -> None:
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


# --------------------------------------------------------------------------------------------- parallel
SIZES = ("parallel.tensor", "parallel.pipeline", "parallel.context", "parallel.expert", "nodes", "cluster.gpus_per_node")


def _validate_moe_routing(c: _Checks, model: ModelConfig) -> None:
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
                  f"model.moe_router_num_groups={_divisor_near(model.num_experts, groups)}"):
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


def _validate_flex_dispatcher(c: _Checks, job: JobConfig, lay: Layout) -> None:
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
    c = _Checks()
    p, model, cluster = job.parallel, job.model, job.cluster
    # Without usable sizes (each reported by validate_bounds) no layout rule can be stated.
    if not in_bounds(job, *SIZES) or (p.expert_tensor is not None and not in_bounds(job, "parallel.expert_tensor")):
        return c.problems
    world, mp = lay.world, lay.model_parallel
    # parallel_state.py: "world_size (W) is not divisible by TP x PP x CP"
    if c.need(lay.dp > 0, _world_culprit(job, lay), _get(job, _world_culprit(job, lay)),
              f"parallel.tensor x parallel.pipeline x parallel.context = {p.tensor}x{p.pipeline}x{p.context} = {mp} "
              f"must divide the world size nodes x cluster.gpus_per_node = {job.nodes}x{cluster.gpus_per_node} = {world}",
              _world_fix(job, lay)):
        if p.data is not None:
            c.need(p.data == lay.dp, "parallel.data", p.data,
                   f"is derived: world {world} / (TP x PP x CP = {mp}) = {lay.dp}", f"parallel.data={lay.dp} or parallel.data=null")
    c.need(p.tensor <= cluster.gpus_per_node, "parallel.tensor", p.tensor,
           f"tensor parallelism must stay inside one node (cluster.gpus_per_node={cluster.gpus_per_node})",
           f"parallel.tensor={_divisor_near(cluster.gpus_per_node, p.tensor)}")
    _validate_tensor_widths(c, p, model)
    if lay.sequence_parallel and in_bounds(job, "model.seq_length"):
        shards = lay.tp * (2 * lay.cp if lay.cp > 1 else 1)
        c.need(model.seq_length % shards == 0, "parallel.sequence_parallel", True,
               f"model.seq_length={model.seq_length} must be divisible by TP{' x 2CP' if lay.cp > 1 else ''} = {shards}",
               f"model.seq_length={_round_up(model.seq_length, shards)} or parallel.sequence_parallel=false")
    _validate_overlap(c, p, lay)
    if in_bounds(job, "model.num_layers"):
        _validate_layer_split(c, p, model, lay)
    if p.context > 1:
        if in_bounds(job, "model.seq_length"):
            # Megatron-LM arguments.py: "seq-length should be a multiple of 2 * context-parallel-size"
            c.need(model.seq_length % (2 * p.context) == 0, "parallel.context", p.context,
                   f"model.seq_length={model.seq_length} must be divisible by 2 x CP (load-balanced causal split)",
                   f"parallel.context={_divisor_near(max(1, model.seq_length // 2), p.context)}")
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


def _validate_tensor_widths(c: _Checks, p: ParallelConfig, model: ModelConfig) -> None:
    """What TP shards must split evenly (TransformerConfig.__post_init__, attention.py, layers.py ``divide``)."""
    tp = p.tensor
    if model.num_attention_heads >= 1:
        c.need(model.num_attention_heads % tp == 0, "parallel.tensor", tp,
               f"must divide model.num_attention_heads={model.num_attention_heads}",
               f"parallel.tensor={_divisor_near(model.num_attention_heads, tp)}")
    groups = model.num_query_groups or model.num_attention_heads
    if groups >= 1 and not model.multi_latent_attention:
        # Stricter than Megatron-Core, which also accepts a TP that is a multiple of the groups and replicates
        # KV heads: the planner's memory and the checkpoints assume KV heads are split over TP.
        c.need(groups % tp == 0, "parallel.tensor", tp,
               f"must divide the query groups model.num_query_groups={groups} (KV-head replication, which "
               "Megatron-Core allows when TP is a multiple of the groups, is not planned here)",
               f"parallel.tensor={_divisor_near(groups, tp)}")
    if model.ffn_hidden_size >= 1:
        c.need(model.ffn_hidden_size % tp == 0, "parallel.tensor", tp,
               f"must divide model.ffn_hidden_size={model.ffn_hidden_size} (column-parallel MLP)",
               f"parallel.tensor={_divisor_near(model.ffn_hidden_size, tp)}")


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
            hints.append(f"{name}={_divisor_near(lay.world // others, sizes[name])}")
    return " or ".join(hints)


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


def _validate_fsdp(c: _Checks, job: JobConfig, lay: Layout) -> None:
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


RANK_ACTIONS = ("validate", "render", "submit", "run")
"""Actions that prepare or start a run on this launcher's own ranks (plan, search, list and megatron-args do not)."""


def rank_side_limits(job: JobConfig) -> list[Problem]:
    """What this launcher's ranks cannot run yet although Megatron-Core, the planner and the Megatron-LM export
    can; reported with validation for RANK_ACTIONS only, so such a job still plans, searches and exports."""
    return []


def _validate_cuda_connections(c: _Checks, job: JobConfig, lay: Layout) -> None:
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


def _validate_recompute_modules(c: _Checks, job: JobConfig, lay: Layout) -> None:
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
        (not unknown, f"unknown module(s) {unknown}; known: {', '.join(RECOMPUTE_MODULES)}", without()),
        (job.train.recompute == "selective", "apply to train.recompute=selective only",
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


def _validate_moe_overlap(c: _Checks, job: JobConfig, lay: Layout) -> None:
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
        (job.train.recompute != "full", "cannot be combined with train.recompute=full"),
        (job.precision.dtype in ("bf16", "fp16"), "needs precision.dtype bf16 or fp16"),
        ((model.mtp_num_layers or 0) <= 1, "supports at most one MTP layer (model.mtp_num_layers <= 1)"),
        (lay.transformer_engine, "runs on GPU streams with Transformer Engine layers (GPU clusters only)"),
    ]
    for ok, rule in rules:
        if not c.need(ok, f, True, rule, f"{f}=false"):
            return


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
               f"parallel.pipeline={_divisor_near(max(1, layers // vp), p.pipeline)} or "
               f"model.num_layers={_round_up(layers, chunks)}")
        return
    if (first is not None and first < 1) or (last is not None and last < 1):
        return  # reported by validate_bounds
    middle_stages = p.pipeline - (first is not None) - (last is not None)
    rest = layers - (first or 0) - (last or 0)
    for name, value in (("first_stage_layers", first), ("last_stage_layers", last)):
        if value is not None:
            c.need(value % vp == 0, f"parallel.{name}", value,
                   f"must be a multiple of parallel.virtual_pipeline={vp}", f"parallel.{name}={_round_up(value, vp)}")
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


def _validate_experts(c: _Checks, p: ParallelConfig, model: ModelConfig, lay: Layout) -> None:
    per_stage = lay.world // lay.pp
    # parallel_state.py builds the expert groups for every model: "world_size is not divisible by
    # expert_tensor_model_pipeline_parallel size" (ETP x EP x PP).
    etp_named = p.expert_tensor is not None and per_stage % lay.etp != 0
    c.need(lay.expert_dp > 0 or not lay.dp, "parallel.expert_tensor" if etp_named else "parallel.expert",
           p.expert_tensor if etp_named else p.expert,
           f"parallel.expert_tensor x parallel.expert = {lay.etp}x{lay.ep} must divide the ranks per pipeline "
           f"stage ({per_stage})",
           f"parallel.expert_tensor={_divisor_near(per_stage, lay.etp)}" if etp_named else
           f"parallel.expert={_divisor_near(max(1, per_stage // lay.etp), lay.ep)}")
    if model.num_experts is None:
        # transformer_config.py: "num_moe_experts must be non None to use expert-parallel."
        c.need(p.expert == 1, "parallel.expert", p.expert, "expert parallelism needs an MoE model (model.num_experts)",
               "parallel.expert=1")
        return
    if model.num_experts < 1:
        return  # reported by validate_bounds
    # moe_layer.py: "assert self.config.num_moe_experts % ep_size == 0"
    c.need(model.num_experts % p.expert == 0, "parallel.expert", p.expert,
           f"must divide model.num_experts={model.num_experts}", f"parallel.expert={_divisor_near(model.num_experts, p.expert)}")
    # moe_layer.py refuses MoE with TP but without SP ("... tensor parallelism ... sequence parallelism")
    c.need(p.tensor == 1 or p.sequence_parallel, "parallel.sequence_parallel", p.sequence_parallel,
           "an MoE model (model.num_experts) with tensor parallelism requires sequence parallelism",
           "parallel.sequence_parallel=true")
    expert_ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
    if expert_ffn >= 1:
        # experts are column/row-parallel over the expert-TP group (layers.py ``divide``)
        c.need(expert_ffn % lay.etp == 0, "parallel.expert_tensor" if p.expert_tensor else "parallel.tensor",
               lay.etp, f"expert tensor parallelism must divide the expert width "
               f"model.moe_ffn_hidden_size={expert_ffn}", f"model.moe_ffn_hidden_size={_round_up(expert_ffn, lay.etp)}")
    shared = model.moe_shared_expert_intermediate_size
    if shared is not None and shared >= 1:
        c.need(shared % lay.tp == 0, "model.moe_shared_expert_intermediate_size", shared,
               f"the shared experts are tensor-parallel: must be divisible by parallel.tensor={lay.tp}",
               f"model.moe_shared_expert_intermediate_size={_round_up(shared, lay.tp)}")
    # transformer_config.py: "Bias in Moe is only supported when ETP==1"
    c.need(not model.add_bias_linear or lay.etp == 1, "model.add_bias_linear", True,
           f"MoE with linear biases needs expert tensor parallelism 1 (parallel.expert_tensor is {lay.etp})",
           "parallel.expert_tensor=1 or model.add_bias_linear=false")


# --------------------------------------------------------------------------------------------- schedule
def zb_h1_rules(job: JobConfig) -> list[tuple]:
    """What the zero-bubble executor (launcher/rank/zero_bubble.py) trains, as (holds, field, value, rule, hint);
    validate_schedule checks them all, the layout search those on fields it does not choose itself. Recompute,
    MoE experts (with router and shared experts), MTP, overlap_grad_reduce and the distributed optimizer are
    supported (tests/test_zero_bubble.py: 1F1B's gradients, bitwise); what is refused here, upstream forbids."""
    p, zb = job.parallel, f"{job.schedule.kind} (launcher/rank/zero_bubble.py)"
    return [
        (p.pipeline > 1, "schedule.kind", job.schedule.kind, f"{job.schedule.kind} needs parallel.pipeline > 1",
         "parallel.pipeline=2 (or schedule.kind=1f1b)"),
        # Transformer Engine's Linear backward (transformer_engine/pytorch/module/linear.py:1290-1300, TE 2.20.0.dev0
        # at d0067d0; layernorm_linear.py:1076 and layernorm_mlp.py:1690 the same): "Delayed weight grad
        # computation is not supported with Userbuffers (tensor-parallel communication overlapping)" whenever the
        # wgrad GEMM has a userbuffer, which Megatron-Core's default tp_comm_bulk_wgrad=True gives every
        # column-parallel layer (model_parallel_config.py:271)
        (not p.tp_comm_overlap, "parallel.tp_comm_overlap", True,
         f"{zb} defers weight gradients with TE's delay_wgrad_compute, which Transformer Engine refuses with "
         "userbuffer TP overlap (transformer_engine/pytorch/module/linear.py:1290: \"Delayed weight grad "
         "computation is not supported with Userbuffers\")", "parallel.tp_comm_overlap=false"),
        # megatron/core/pipeline_parallel/schedules.py:751: overlap_moe_expert_parallel_comm runs Megatron's
        # combined 1F1B schedule instead of the one asked for
        (not p.moe_a2a_overlap, "parallel.moe_a2a_overlap", True, f"{zb}: parallel.moe_a2a_overlap is "
         "Megatron's combined 1F1B schedule (megatron/core/pipeline_parallel/schedules.py:751), a schedule of "
         "its own", "parallel.moe_a2a_overlap=false"),
        # TE (2.7 .. 2.18) under FP8 computes the bias gradient in B (grad_output_preprocess) and gives the
        # delayed wgrad GEMM bias=None (linear.py: "bias": bias if (grad_bias is None and not fp8) else None);
        # its backward_dw then sets an empty bias grad from that None (base.py TransformerEngineBaseModule.
        # backward_dw: bias_tensor.grad = bgrad.to(...); layernorm_mlp.py the same for fc1/fc2 biases). A stage
        # >= 1 runs a second B before the first W (DDP's hook then took the bias grad): AttributeError there.
        (precision_fp8_without_biases(job), "model.add_bias_linear" if job.model.add_bias_linear
         else "model.add_qkv_bias", True, f"{zb} with precision.fp8 and linear biases fails in Transformer "
         "Engine's backward_dw (transformer_engine/pytorch/module/base.py: bias_tensor.grad = bgrad.to(...) with "
         "bgrad None under FP8)", " ".join(f"model.{b}=false" for b in ("add_bias_linear", "add_qkv_bias")
                                  if getattr(job.model, b)) + " or precision.fp8=null precision.fp8_param=false"),
    ]


def zb_v_rules(job: JobConfig, lay: Layout) -> list[tuple]:
    """ZB-V's own layout rules (launcher.core.schedules.schedule_zb_v: two chunks per rank in a V, so rank 0
    holds both the first and the last stage)."""
    p = job.parallel
    uneven = next((name for name in ("first_stage_layers", "last_stage_layers", "pipeline_model_parallel_layout",
                                     "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
                   if getattr(p, name) not in (None, False)), None)
    return [
        # no virtual pipeline (or none to place it on) is the schedule's problem, as for interleaved; another
        # chunk count is the virtual pipeline's
        (p.pipeline == 1 or lay.vpp > 1, "schedule.kind", job.schedule.kind,  # PP 1: the zero-bubble rules say it
         "zb_v places exactly two model chunks on each rank (chunk 0 on ranks 0..p-1, chunk 1 back on p-1..0): it "
         "needs parallel.virtual_pipeline=2", "parallel.virtual_pipeline=2 or schedule.kind=1f1b"),
        (lay.vpp in (1, 2), "parallel.virtual_pipeline", p.virtual_pipeline,
         "zb_v places exactly two model chunks on each rank (chunk 0 on ranks 0..p-1, chunk 1 back on p-1..0)",
         "parallel.virtual_pipeline=2"),
        (uneven is None, f"parallel.{uneven}", getattr(p, uneven) if uneven else None,
         "zb_v splits the layers evenly over its 2 x parallel.pipeline stages (uneven splits assume the "
         "interleaved placement, with the last stage on the last rank; in the V it is on rank 0)",
         f"parallel.{uneven}={'false' if uneven and uneven.startswith('account') else 'null'}"),
        (job.schedule.zb_v_costs is None or (len(job.schedule.zb_v_costs) == 3
                                              and all(c > 0 for c in job.schedule.zb_v_costs)),
         "schedule.zb_v_costs", job.schedule.zb_v_costs, "three relative per-chunk costs [T_F, T_B, T_W], each > 0",
         "schedule.zb_v_costs=null (equal costs) or schedule.zb_v_costs=[1,1,1]"),
        # megatron/core/transformer/multi_token_prediction.py:635 (mtp_on_this_rank, 0.19.2): without a custom
        # layout the MTP layers go where parallel_state's pipeline rank is the last one, rank p - 1, which in
        # the V holds the middle stages; the loss (and the data MTP reads) is on rank 0
        (not job.model.mtp_num_layers, "model.mtp_num_layers", job.model.mtp_num_layers, "zb_v keeps the last "
         "stage on rank 0, but Megatron-Core places MTP layers on the last pipeline rank (megatron/core/transformer/"
         "multi_token_prediction.py:635 mtp_on_this_rank reads parallel_state's rank)",
         "model.mtp_num_layers=0 (or schedule.kind=zb_h1 parallel.virtual_pipeline=null)"),
        # ours, not upstream's: Megatron ties the two copies with an all-reduce over the embedding group (first
        # and last pipeline rank); in the V both are on rank 0, in two chunks, and that sync is not built
        (not job.model.tie_embeddings, "model.tie_embeddings", True, "zb_v puts the embedding and the output "
         "layer on rank 0 in two model chunks; tying them there is not implemented (launcher/rank/zero_bubble.py)",
         "model.tie_embeddings=false (or schedule.kind=interleaved)"),
    ]


def precision_fp8_without_biases(job: JobConfig) -> bool:
    """zb_h1 trains FP8 only without linear biases (TE's backward_dw, see zb_h1_rules)."""
    return job.precision.fp8 is None or not (job.model.add_bias_linear or job.model.add_qkv_bias)


def validate_schedule(job: JobConfig, lay: Layout) -> list[Problem]:
    c = _Checks()
    s, p = job.schedule, job.parallel
    if not _allowed(s, "kind"):
        return c.problems  # reported by validate_choices
    vp, m = lay.vpp, lay.microbatches
    if s.kind in ("zb_h1", "zb_v") and job.action not in ("plan", "search"):  # what the ZB executor supports
        for ok, field, value, rule, hint in zb_h1_rules(job):
            c.need(ok, field, value, rule, hint)
    if s.kind == "zb_v":
        for ok, field, value, rule, hint in zb_v_rules(job, lay):
            c.need(ok, field, value, rule, hint)
    elif s.kind == "interleaved":
        c.need(vp > 1 and p.pipeline > 1, "schedule.kind", s.kind,
               "interleaved needs parallel.pipeline > 1 and parallel.virtual_pipeline > 1",
               "parallel.virtual_pipeline=2 or schedule.kind=1f1b")
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


# ------------------------------------------------------------------------------------------------ train
def validate_train(job: JobConfig, lay: Layout) -> list[Problem]:
    """Batch, length and optimizer rules (ranges are in ``BOUNDS``; Megatron-LM arguments.py for the rest)."""
    c = _Checks()
    t = job.train
    dp = lay.dp
    if dp and in_bounds(job, "train.micro_batch_size", "train.global_batch_size"):
        unit = t.micro_batch_size * dp
        c.need(t.global_batch_size % unit == 0, "train.global_batch_size", t.global_batch_size,
               f"must be divisible by train.micro_batch_size x DP = {t.micro_batch_size}x{dp} = {unit}",
               f"train.global_batch_size={_round_up(max(t.global_batch_size, unit), unit)}")
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
    if t.recompute_num_layers is not None and t.recompute_num_layers >= 1 and _allowed(t, "recompute"):
        # transformer_config.py: with full recompute "recompute_num_layers must be between 1 and
        # num_layers_per_pipeline_rank"; with selective "recompute_num_layers must be None".
        c.need(t.recompute == "full", "train.recompute_num_layers", t.recompute_num_layers,
               f"is only used with train.recompute=full (got {t.recompute})",
               "train.recompute_num_layers=null or train.recompute=full")
        # multi_token_prediction.py: "recompute_num_layers must be 1 for MTP recompute"
        c.need(not (t.recompute == "full" and job.model.mtp_num_layers and t.recompute_num_layers != 1),
               "train.recompute_num_layers",
               t.recompute_num_layers, "full recompute with multi-token prediction (model.mtp_num_layers > 0) "
               "recomputes one layer at a time", "train.recompute_num_layers=1 or train.recompute_num_layers=null")
        per_chunk = min((len(chunk) for stage in lay.chunk_layers for chunk in stage), default=0)
        c.need(t.recompute != "full" or t.recompute_num_layers <= max(per_chunk, 1), "train.recompute_num_layers",
               t.recompute_num_layers, f"must be at most the layers of one pipeline chunk ({per_chunk})",
               f"train.recompute_num_layers={max(per_chunk, 1)} or train.recompute_num_layers=null")
    return c.problems


# ------------------------------------------------------------------------------------------------- data
def validate_data(data: DataConfig) -> list[Problem]:
    c = _Checks()
    if not _allowed(data, "kind"):
        return c.problems  # reported by validate_choices
    parts = [s.strip() for s in str(data.split).split(",")]
    c.need(len(parts) == 3 and all(is_number(s) and 0 <= float(s) < math.inf for s in parts) and any(float(s) > 0 for s in parts if is_number(s)),
           "data.split", data.split, "must be three non-negative weights train,valid,test", "data.split='969,30,1'")
    c.need(data.kind != "mock" or not data.blend, "data.kind", data.kind,
           "mock data ignores data.blend: a blend was given but would never be read",
           "data.blend=[] or data.kind=indexed")
    if data.kind == "indexed":
        c.need(len(data.blend) > 0, "data.blend", list(data.blend), "indexed data needs at least one dataset prefix",
               "list your dataset prefixes in data.blend or data=mock")
        c.need(bool(data.tokenizer), "data.tokenizer", data.tokenizer, "indexed data needs a tokenizer.json path",
               f"data.tokenizer={ROOT / 'data' / 'assets' / 'tokenizer.json'}")  # absolute: relative means the cwd
        problem = blend_structure_problem(list(data.blend))
        if problem:
            c.problems.append(problem)
    return c.problems


def blend_structure_problem(blend: list) -> Problem | None:
    try:
        pairs = parse_blend(blend)
    except ValueError:
        return Problem("data.blend", blend, "must be [prefix, ...] or [weight, prefix, weight, prefix, ...]",
                       "data.blend=[0.3,path/a,0.7,path/b]")
    bad = [w for w, _ in pairs if not (w > 0 and math.isfinite(w))]
    if bad:
        return Problem("data.blend", blend, f"weights must be positive finite numbers (got {bad[0]:g})",
                       "remove the dataset from the blend or give it a positive weight")
    return None


# ---------------------------------------------------------------------------------------- run, cluster
def validate_checkpoint(ckpt: CheckpointConfig) -> list[Problem]:
    c = _Checks()
    # The rank wing refuses async_save (its saves are synchronous): refuse it here, before any GPU is spent.
    c.need(not ckpt.async_save, "checkpoint.async_save", True,
           "asynchronous saving is not implemented: the ranks write checkpoints synchronously and refuse it",
           "checkpoint.async_save=false")
    if ckpt.load is not None:
        c.need(str(ckpt.load).strip() != "", "checkpoint.load", ckpt.load,
               "names a checkpoint (an iter_* directory) or a checkpoint dir holding some",
               "checkpoint.load=/lustre/ckpt/run/iter_0001000")
    if ckpt.load_hf is not None:  # rendering imports it and sets checkpoint.load (launcher/actions.py hf_start)
        c.need(ckpt.load is None, "checkpoint.load_hf", ckpt.load_hf,
               f"a run starts from one thing; checkpoint.load={ckpt.load} is set too", "checkpoint.load=null")
        c.need(bool(str(ckpt.load_hf).strip()) and os.path.isfile(os.path.join(str(ckpt.load_hf), "config.json")),
               "checkpoint.load_hf", ckpt.load_hf,
               "names a Hugging Face model directory (config.json and safetensors weights); no config.json there",
               "checkpoint.load_hf=null")
    return c.problems


def validate_loaded_weights(job: JobConfig) -> list[Problem]:
    """checkpoint.load of an ``import-hf`` checkpoint (weights only): its launcher.json records the model fields that
    shape its tensors (launcher/hf/importer.py WEIGHT_FIELDS); each one this job's model sets differently is one
    problem here, before any rank starts (the ranks check the same, launcher/rank/checkpoint.py weights_mismatch).
    A path this node cannot read is left to the ranks."""
    from launcher.core.checkpoint_dir import read_manifest

    if not job.checkpoint.load:
        return []
    manifest = read_manifest(job.checkpoint.load)
    recorded = manifest.get("weights_of") if isinstance(manifest, dict) else None
    if not isinstance(recorded, dict):
        return []
    problems = []
    for key, theirs in sorted(recorded.items()):
        ours = getattr(job.model, key.partition(".")[2], None)
        if key.startswith("model.") and ours != theirs:
            problems.append(Problem(key, ours, f"the weights of checkpoint.load={job.checkpoint.load} have "
                                    f"{key}={theirs!r}", f"{key}={'null' if theirs is None else theirs}"))
    return problems


def validate_logging(logging: LoggingConfig) -> list[Problem]:
    c = _Checks()
    # wandb refuses project and entity names with '/', '\\', '#', '?', '%', ':' (every rank would fail in
    # wandb.init); ';' and spaces are refused too so the names stay shell- and path-safe.
    for name, value in (("logging.wandb_project", logging.wandb_project), ("logging.wandb_entity", logging.wandb_entity)):
        if value is not None:
            c.need(WANDB_NAME.fullmatch(str(value)) is not None, name, value,
                   "wandb names are 1-128 letters, digits, '.', '_' and '-'", f"{name}=my_project")
    return c.problems


def validate_cluster(job: JobConfig) -> list[Problem]:
    c = _Checks()
    cl = job.cluster
    if in_bounds(job, "cluster.gpu_memory_gb", "cluster.memory_reserve_gb"):
        c.need(cl.memory_reserve_gb < cl.gpu_memory_gb, "cluster.memory_reserve_gb", cl.memory_reserve_gb,
               f"must be less than cluster.gpu_memory_gb={cl.gpu_memory_gb:g}", "cluster.memory_reserve_gb=4.0")
    c.need(not (cl.gpu == "cpu" and cl.backend == "nccl"), "cluster.backend", cl.backend,
           "NCCL needs GPUs; a cpu cluster uses gloo", "cluster.backend=gloo")
    c.need(cl.launcher != "local" or job.nodes == 1, "nodes", job.nodes,
           "a local cluster runs on this one machine", "nodes=1 or cluster=h200 (to submit with Slurm)")
    c.need(job.action != "run" or cl.launcher == "local", "action", job.action,
           f"action=run starts torchrun on this machine; cluster {cl.name} launches through Slurm",
           "action=submit or cluster=local")
    c.need(job.action != "submit" or cl.launcher == "slurm", "action", job.action,
           f"action=submit needs a Slurm cluster profile; cluster {cl.name} runs locally",
           "action=run or a Slurm profile such as cluster=h200")
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
    if seconds is not None and s.signal_lead_s is None:  # derived at render (launcher/core/signal_lead.py)
        c.need(not 0 <= s.signal_margin_s or s.signal_margin_s + 60 <= seconds // 2, "slurm.signal_margin_s",
               s.signal_margin_s, f"must leave half of the {seconds} s time limit for training (margin + 60 s)",
               f"slurm.signal_margin_s={min(60, max(0, seconds // 2 - 60))}")
    elif seconds is not None:  # (a negative lead is BOUNDS' to report)
        c.need(s.signal_lead_s < seconds or s.signal_lead_s < 0, "slurm.signal_lead_s", s.signal_lead_s,
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
    # slurm.max_requeues, cluster.max_restarts, the signal factor and margin: ranges in BOUNDS
    return c.problems


from launcher.core.determinism import ACCEPTED as ACCEPTED_DETERMINISTIC  # noqa: E402

MAX_NAME = 128
"""Longest run name (the bundle directory adds a 16-character stamp and a counter; file names stop at 255 bytes)."""


def validate_job(job: JobConfig) -> list[Problem]:
    c = _Checks()
    c.need(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", job.name or "") is not None, "name", job.name,
           "run names are letters, digits, '.', '_' and '-'", "name=my_run")
    c.need(len(job.name or "") <= MAX_NAME, "name", job.name, f"run names are at most {MAX_NAME} characters (the "
           "bundle directory <name>-<UTC stamp> must fit a file name's 255 bytes, the Slurm job name stays readable)",
           f"name={(job.name or 'run')[:40]}")
    return c.problems


def validate_sizes(job: JobConfig) -> list[Problem]:
    """Sizes so large that they can only be typos; checked before anything is derived, because the layout
    holds a table per layer and per (virtual) pipeline chunk."""
    c = _Checks()
    for name, value, most in (("model.num_layers", job.model.num_layers, MAX_LAYERS),
                              ("model.mtp_num_layers", job.model.mtp_num_layers, MAX_LAYERS),
                              ("parallel.first_stage_layers", job.parallel.first_stage_layers, MAX_LAYERS),
                              ("parallel.last_stage_layers", job.parallel.last_stage_layers, MAX_LAYERS),
                              ("parallel.pipeline", job.parallel.pipeline, MAX_PIPELINE),
                              ("parallel.virtual_pipeline", job.parallel.virtual_pipeline, MAX_PIPELINE)):
        c.need(value is None or value <= most, name, value, f"must be at most {most} (a typo?)", f"{name}=1")
    return c.problems


def validate_finite(job: JobConfig) -> list[Problem]:
    """No float field may be inf or nan (Hydra reads ``train.lr=inf`` as a float; every rank would train on
    it). Checked before anything is derived, like the sizes."""
    c = _Checks()
    for name, (cls, kind) in _FIELD_TYPES.items():
        section, _, attr = name.rpartition(".")
        value = getattr(getattr(job, section) if section else job, attr)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if "float" in kind:
            c.need(math.isfinite(value), name, value, "must be a finite number", f"{name}={_default_text(name)}")
        elif "int" in kind:  # Python ints are unbounded; torch and the index files hold 64 bits
            c.need(abs(value) < 2**63, name, value, "must fit in 64 bits", f"{name}={_default_text(name)}")
    return c.problems


def validate_profile(job: JobConfig, lay: Layout) -> list[Problem]:
    """profile.*: a step range the run reaches, ranks that exist, nsys and memory snapshots only where CUDA is."""
    c, p = _Checks(), job.profile
    if p.kind != "none":
        c.need(p.step_end > p.step_start, "profile.step_end", p.step_end,
               f"must be after profile.step_start={p.step_start} (profiling stops before step_end)",
               f"profile.step_end={p.step_start + 2}")
        if lay.steps:
            c.need(p.step_start <= lay.steps, "profile.step_start", p.step_start,
                   f"the run has {lay.steps} steps: profiling would never start",
                   f"profile.step_start={max(1, min(3, lay.steps))}")
        bad = [r for r in p.ranks if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < lay.world]
        c.need(bool(p.ranks) and not bad, "profile.ranks", list(p.ranks),
               f"must name global ranks of this job (0..{lay.world - 1})", "profile.ranks=[0]")
        c.need(p.kind != "nsys" or job.cluster.gpu != "cpu", "profile.kind", p.kind,
               "Nsight Systems captures CUDA work; this job runs on CPU", "profile.kind=torch")
    c.need(not p.memory_snapshot or job.cluster.gpu != "cpu", "profile.memory_snapshot", p.memory_snapshot,
           "records the CUDA caching allocator; this job runs on CPU, so there is nothing to record",
           "profile.memory_snapshot=false", severity="warning")
    return c.problems


def validate_deterministic(job: JobConfig) -> list[Problem]:
    """train.deterministic: the settings and cluster.env values Megatron-LM's --deterministic-mode refuses."""
    from launcher.core.determinism import ENV_DEFAULTS, REFUSED_SETTINGS, env_problems

    c = _Checks()
    if not job.train.deterministic:
        return c.problems
    for name, why, needed in REFUSED_SETTINGS:
        value = _get(job, name)
        c.need(value == needed, name, value, f"train.deterministic=true refuses it: {why}",
               f"{name}={str(needed).lower()}, or train.deterministic=false")
    for var, value, rule in env_problems(dict(job.cluster.env)):
        fix = ENV_DEFAULTS.get(var) or (ACCEPTED_DETERMINISTIC.get(var) or ("1",))[0]
        c.need(False, f"cluster.env.{var}", value, f"train.deterministic=true: {rule}", f"cluster.env.{var}={fix}")
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
    lambda j, lay: validate_loaded_weights(j),
    lambda j, lay: validate_logging(j.logging),
    lambda j, lay: validate_slurm(j),
    validate_profile,
    lambda j, lay: validate_deterministic(j),
)
"""Each section's rules, in report order; the cross-section ones read the derived layout."""



def validate(job: JobConfig) -> list[Problem]:
    """Every problem of every section (errors and warnings), in section order, each hint verified: an
    alternative is printed only when the job with it applied no longer has that problem and has no new error
    (see ``verified_hint``)."""
    problems = raw_problems(job)
    return [verified_hint(job, p, problems) for p in problems]


def raw_problems(job: JobConfig) -> list[Problem]:
    """The problems as the rules state them, hints unchecked."""
    problems = validate_sizes(job) + validate_finite(job)
    if errors(problems):
        return problems
    problems += validate_bounds(job)
    lay = derive(job)
    for check in SECTION_CHECKS:
        try:
            problems.extend(check(job, lay))
        except Exception as exc:  # noqa: BLE001  -- a rule that cannot be stated is reported, never a traceback
            problems.append(Problem("config", f"{type(exc).__name__}: {exc}",
                                    "a validation rule could not be evaluated (a bug in launcher/validate.py)",
                                    "fix the other reported problems first"))
    return problems


# ------------------------------------------------------------------------------------- verified hints
OVERRIDE = re.compile(r"([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)?)=(\S+)")
"""One ``section.field=value`` (or top-level ``field=value``) override in a hint."""


def _key(p: Problem) -> tuple[str, str]:
    """What identifies a problem across re-validation: its field and its rule without the numbers in it."""
    return p.field.split("[")[0], re.sub(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?", "#", p.rule)


def verified_hint(job: JobConfig, problem: Problem, problems: list[Problem]) -> Problem:
    """The problem with only those alternatives of its hint that fix it without a new error; alternatives
    that are not plain overrides (prose, group options such as cluster=h100) are kept as written. When every
    override alternative fails, the schema default of the field it set is tried; failing that, the hint
    names what to change without a number."""
    alternatives = [a.strip() for a in re.split(r"\s+or\s+", problem.hint) if a.strip()]
    parsed = [(a, _overrides(a)) for a in alternatives]
    if all(ov is None for _, ov in parsed):
        return problem
    before = {_key(p) for p in errors(problems)}
    kept = [a for a, ov in parsed if ov is None or _fixes(job, ov, problem, before)]
    tried = [ov for _, ov in parsed if ov]
    if not any(ov for a, ov in parsed if a in kept):
        for ov in tried:  # the schema's default for the same field(s)
            default = [(k, _default_text(k)) for k, _ in ov]
            if all(t is not None for _, t in default) and default != ov and _fixes(job, default, problem, before):
                kept.insert(0, " ".join(f"{k}={t}" for k, t in default))
                break
    if not any(_overrides(a) for a in kept):
        names = list(dict.fromkeys([k for ov in tried for k, _ in ov]
                                   + ([problem.field] if problem.field in _FIELD_TYPES else [])))
        kept = [a for a in kept if _overrides(a) is None]
        found = _searched_alternative(job, problem, before, names, tried)
        kept.insert(0, found or f"a different value of {' or '.join(sorted(names))}")
    return dataclasses.replace(problem, hint=" or ".join(dict.fromkeys(kept)))


SIZE_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)
"""Round sizes tried for an integer field when no stated alternative fixes its problem."""
SEARCHED_PER_FIELD = 24
"""At most this many values are tried per field (each try re-validates a copy: ~0.5 ms)."""


def _searched_alternative(job: JobConfig, problem: Problem, before: set, names: list[str],
                          stated: list) -> str | None:
    """When no stated alternative fixes the problem (it was, say, one of two errors a single override caused): the
    nearest value of one of the fields the rule names that fixes it without a new error, so the printed hint stays
    a checked override. Integers: multiples of the stated (or current) value and round sizes, nearest first;
    choices and booleans: the other options."""
    for name in names:
        for text in _candidate_values(job, name, [t for ov in stated for k, t in ov if k == name])[:SEARCHED_PER_FIELD]:
            if _fixes(job, [(name, text)], problem, before, own_fields_clean=True):
                return f"{name}={text}"
    return None


def _candidate_values(job: JobConfig, name: str, stated: list[str]) -> list[str]:
    cls, kind = _FIELD_TYPES[name]
    section, _, attr = name.rpartition(".")
    current = getattr(getattr(job, section) if section else job, attr)
    f = cls.__dataclass_fields__[attr]
    null = ["null"] if kind.startswith("Optional") and current is not None else []
    if "choices" in f.metadata:
        return [str(c) for c in f.metadata["choices"] if c != current] + null
    if "bool" in kind:
        return ["false" if current else "true"] + null
    if "int" not in kind or "List" in kind or "Dict" in kind:
        return null
    ref = next((int(t) for t in stated if t.isascii() and t.isdigit() and int(t) > 0), None)
    ref = ref or (current if isinstance(current, int) and not isinstance(current, bool) and current > 0 else 1)
    ref = min(ref, SIZE_LADDER[-1])  # an absurd value (10**400) is not a reference: the ladder is
    values = (set(SIZE_LADDER) | {ref * k for k in range(1, 9)}) - {current}
    return [str(v) for v in sorted(values, key=lambda v: (abs(math.log(v) - math.log(ref)), v))] + ["0"] + null


def _overrides(text: str) -> list[tuple[str, str]] | None:
    """[(field, value)] when ``text`` is one or more schema-field overrides separated by spaces, else None."""
    tokens = text.split()
    pairs = [OVERRIDE.fullmatch(t) for t in tokens]
    if not tokens or not all(pairs) or not all(m[1] in _FIELD_TYPES for m in pairs):
        return None
    return [(m[1], m[2]) for m in pairs]


def _fixes(job: JobConfig, overrides: list[tuple[str, str]], problem: Problem, before: set,
           own_fields_clean: bool = False) -> bool:
    """The overrides remove the problem without a new error (and, with ``own_fields_clean``, leave no error on the
    fields they set: an earlier error of the job, say a bound, can hide the rules a searched value would break,
    which run only once the bounds hold)."""
    fixed = copy.deepcopy(job)
    try:
        for key, text in overrides:
            _set(fixed, key, text)
        after = raw_problems(fixed)
    except Exception:  # noqa: BLE001  -- a hint the job cannot even take is not printed
        return False
    keys = {_key(p) for p in after if p.severity == "error" or p.severity == problem.severity}
    new_errors = {_key(p) for p in errors(after)} - before
    touched = {k for k, _ in overrides} if own_fields_clean else set()
    return _key(problem) not in keys and not new_errors and not any(
        p.field.split("[")[0] in touched for p in errors(after))


def _schema_fields() -> dict[str, tuple[type, str]]:
    """dotted name -> (section class, annotation text) of every field (top-level ones as ``nodes``...)."""
    out = {}
    for f in dataclasses.fields(JobConfig):
        section = SECTIONS.get(f.name)
        if section is None:
            out[f.name] = (JobConfig, str(f.type))
        else:
            out.update({f"{f.name}.{g.name}": (section, str(g.type)) for g in dataclasses.fields(section)})
    return out


_FIELD_TYPES = _schema_fields()


def parse_value(key: str, text: str):
    """``text`` as the value of field ``key`` (the subset of Hydra's override grammar that hints use)."""
    kind = _FIELD_TYPES[key][1]
    text = text.strip("'\"")
    if text == "null":
        if not kind.startswith("Optional"):
            raise ValueError(f"{key} is not nullable")
        return None
    if "List" in kind:
        inner = text.strip("[]")
        return [s.strip() for s in inner.split(",") if s.strip()] if inner else []
    if "Dict" in kind:
        raise ValueError("dict fields are not set by hints")
    if "bool" in kind:
        if text.lower() not in ("true", "false"):
            raise ValueError(text)
        return text.lower() == "true"
    if "int" in kind:
        return int(text)
    if "float" in kind:
        return float(text)
    return text


def _set(job: JobConfig, key: str, text: str) -> None:
    section, _, name = key.rpartition(".")
    setattr(getattr(job, section) if section else job, name, parse_value(key, text))


def _default_text(key: str) -> str | None:
    """The schema default of a field, spelt as an override value (None: no simple default)."""
    section, _, name = key.rpartition(".")
    cls = SECTIONS[section] if section else JobConfig
    f = cls.__dataclass_fields__[name]
    if f.default is dataclasses.MISSING:
        return None
    value = f.default
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


# -------------------------------------------------------------------------------------------- helpers
@lru_cache(maxsize=4096)
def _divisor_near(n: int, want: int) -> int:
    """The divisor of n closest to want (ties go lower): a valid value to suggest."""
    n, want = max(1, int(n)), max(1, int(want))
    if n > 10**10:  # too many candidates to enumerate: the largest divisor of n that divides want
        return math.gcd(n, want)
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
