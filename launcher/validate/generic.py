"""What every field obeys by its declaration, and what the section rules share.

Ranges (``BOUNDS``, declared once per numeric field), the schema's ``choice`` values, finite numbers and sizes
that can only be typos are checked here, generically; the cross-field rules live in the section modules beside
this one. ``Checks`` collects a section's problems; ``divisor_near`` and ``round_up`` compute the valid value a
hint suggests. Login-node code.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from functools import lru_cache

from launcher.fields import FIELD_TYPES, choice_fields, default_text, get_value, is_allowed
from launcher.problems import Problem
from launcher.schema import SECTIONS, JobConfig


MAX_LAYERS = 100_000
"""Deeper than any published decoder (a few hundred layers): a larger value is a typo."""

MAX_PIPELINE = 1024
"""Pipeline and virtual-pipeline sizes above this are typos; the layout's per-chunk table has PP x VPP entries."""


class Checks:
    """Collects problems; ``need(cond, ...)`` records one when cond is false."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def need(self, cond: bool, field: str, value, rule: str, hint: str, severity: str = "error") -> bool:
        if not cond:
            self.problems.append(Problem(field, value, rule, hint, severity))
        return bool(cond)


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
    # indexed_dataset.DType.optimal_dtype: uint16 below 65500 ids, else int32, the widest the preprocessors write; a
    # larger vocabulary has ids no dataset of ours can hold (and an embedding of vocab x hidden no GPU can)
    "model.vocab_size": Bound(1, 2 ** 31, why="token ids are int32 at most in Megatron's indexed datasets"),
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
    # a factor of 1 or less fires on about every other step (the median) or every step
    "train.spike_factor": Bound(1, lo_open=True, why="1 or less fires on every other step"),
    "train.spike_window": Bound(3, why="a median of fewer steps is one noisy loss"),
    "train.spike_lr_factor": Bound(0, 1, lo_open=True, why="a lower rate after a spike"),
    "train.spike_lr_steps": NON_NEGATIVE,
    "train.warmup_steps": NON_NEGATIVE, "train.eval_interval": Bound(0, why="0 disables"),
    # torch.optim.Adam: "Invalid learning rate / epsilon / beta parameter / weight_decay value"
    # Adam's step size: every published recipe is below 1e-2; 1 and above move each weight by its own size a step
    "train.lr": Bound(0, 1, lo_open=True, hi_open=True, why="Adam's step size"),
    "train.min_lr": Bound(0, 1, hi_open=True, why="Adam's step size"), "train.weight_decay": Bound(0),
    "train.adam_beta1": PROBABILITY, "train.adam_beta2": PROBABILITY,
    "train.adam_eps": Bound(0, lo_open=True, why="Adam divides by sqrt(v) + eps"),
    "train.clip_grad": Bound(0, why="0 disables clipping"),
    # hybrid_optimizer.py: the offload threshold is this share of the device parameters' elements
    "train.optimizer_offload_fraction": Bound(0, 1), "train.cuda_graph_warmup_steps": NON_NEGATIVE,
    # transformer_config.py: "activation_offload_fraction must be in range [0, 1]."; "min_offloaded_tensor_size
    # must be non-negative."
    "train.activation_offload_fraction": Bound(0, 1), "train.min_offloaded_tensor_size": NON_NEGATIVE,
    "train.exit_after_minutes": POSITIVE_NUMBER,
    # torch.manual_seed takes 64 bits; the ranks offset the seed per layer (x 1000003) and per rank
    "train.seed": Bound(0, 2**31 - 1),
    "data.num_workers": NON_NEGATIVE, "checkpoint.save_interval": Bound(0, why="0: only at the end"),
    "checkpoint.keep_last": POSITIVE, "logging.log_interval": POSITIVE,
    "cluster.gpus_per_node": POSITIVE, "cluster.memory_reserve_gb": Bound(0),
    # per GPU: a B200's dense FP8 peak is about 4,500 TFLOP/s; 10^5 leaves room and refuses 1e308 (the planner's
    # step time then rounds to 0)
    **{f"cluster.{n}": Bound(0, 1e5, lo_open=True, why="TFLOP/s per GPU") for n in ("peak_tflops_bf16",
                                                                                   "peak_tflops_fp8")},
    **{f"cluster.{n}": POSITIVE_NUMBER for n in ("gpu_memory_gb",
                                                 "hbm_bandwidth_gbps", "nvlink_bandwidth_gbps",
                                                 "network_bandwidth_gbps", "host_bandwidth_gbps", "host_memory_gb")},
    **{f"cluster.{n}": FRACTION for n in ("gemm_efficiency", "fp8_gemm_efficiency", "comm_efficiency",
                                         "network_efficiency")},
    # a second of overhead per op would price a layer pass at minutes; fitted CPU values are tens of microseconds
    "cluster.op_overhead_us": Bound(0, 1e6, why="microseconds per op; 0 on GPUs"),
    "cluster.compute_units_per_node": Bound(0, 1e6, lo_open=True, why="cores (or GPUs) the ranks share; null: "
                                                                      "one per rank"),
    "slurm.signal_lead_s": NON_NEGATIVE, "nodes": POSITIVE,
    # nothing lost, nothing hangs: requeue/restart budgets, the stop-in-time arithmetic, the straggler report
    "slurm.max_requeues": Bound(0, why="0: never requeue"),
    "cluster.max_restarts": Bound(0, why="torchrun --max-restarts; null: 3 on Slurm, 0 locally"),
    "slurm.signal_save_factor": Bound(1, why="the next save may be as slow as the last"),
    "slurm.signal_margin_s": NON_NEGATIVE, "cluster.checkpoint_write_gbps": POSITIVE_NUMBER,
    "train.straggler_interval": Bound(0, why="0 disables"),
    "train.straggler_margin": Bound(0, lo_open=True, why="relative to the median step time"),
    "profile.step_start": POSITIVE, "profile.step_end": POSITIVE, "profile.memory_snapshot_entries": POSITIVE,
    "timeouts.collective_s": Bound(1, why="seconds; null derives it from the plan"),
    "timeouts.heartbeat_s": Bound(1, why="seconds; null: the collective timeout + 120 s"),
    "timeouts.hang_s": Bound(1, why="seconds; null derives it from the plan"),
    "post.eval_samples": Bound(1, 1e6, why="sequences of model.seq_length tokens per checkpoint"),
}
"""Every numeric field's range, declared once: checked by ``validate_bounds`` and quoted when Hydra cannot
even convert a value (``field_rule``). Cross-field rules live in the sections below."""

NOT_BOUNDED: dict[str, str] = {
    # lists of numbers: BOUNDS ranges one number; their rules read the whole list and the layout
    "schedule.zb_v_costs": "a list: its length (3 or 6 x PP), each cost's range and their spread are one rule, "
                           "launcher/validate/schedule.py zb_v_costs_in_range",
    "profile.ranks": "a list: each entry must be a global rank of this job (0..world-1), launcher/validate/run.py "
                     "validate_profile",
}
"""The numeric fields (int or float, or lists of them) without a ``BOUNDS`` entry, each with why; every numeric
schema field is in exactly one of the two (tests/test_bounds.py)."""


def in_bounds(job: JobConfig, *names: str) -> bool:
    """All the named fields hold a usable value (set, and inside their declared range)."""
    for name in names:
        value = get_value(job, name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if not (math.isfinite(value) and BOUNDS.get(name, Bound()).holds(value)):
            return False
    return True


def field_rule(name: str) -> str:
    """A field's type and range in words, e.g. ``a positive integer (or null)``."""
    kind = FIELD_TYPES[name][1] if name in FIELD_TYPES else ""
    nullable = " (or null)" if kind.startswith("Optional") else ""
    section, _, attr = name.rpartition(".")
    cls = SECTIONS[section] if section else JobConfig
    meta = cls.__dataclass_fields__[attr].metadata if attr in cls.__dataclass_fields__ else {}
    if "choices" in meta:
        return "one of " + ", ".join(map(str, meta["choices"])) + nullable
    integer = "int" in kind
    if name in BOUNDS:
        return BOUNDS[name].describe(integer) + nullable
    # containers first: Optional[List[float]] is a list of numbers, not a number
    for word, text in (("List[float]", "a list of numbers such as [1.0,2.5]"),
                       ("List[int]", "a list of integers such as [0,1]"), ("List", "a list such as [a,b]"),
                       ("Dict", "a mapping"), ("bool", "true or false"), ("int", "an integer"), ("float", "a number"),
                       ("str", "a string")):
        if word in kind:
            return text + nullable
    return "a value of the schema's type" + nullable


def validate_bounds(job: JobConfig) -> list[Problem]:
    """Every numeric field inside its declared range (``BOUNDS``); nulls are left to the rules that need a value."""
    c = Checks()
    for name, bound in BOUNDS.items():
        value = get_value(job, name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue  # null is allowed where the schema allows it; non-finite is reported by validate_finite
        integer = "int" in FIELD_TYPES[name][1]
        c.need(bound.holds(value), name, value, f"must be {bound.describe(integer)}", f"{name}={_bound_hint(name, bound)}")
    return c.problems


def _bound_hint(name: str, bound: Bound) -> str:
    default = default_text(name)
    if default not in (None, "null") and bound.holds(float(default)):
        return default
    # the low end, else one above it (an open low end: train.spike_factor > 1, whose default is null)
    lo = bound.lo if bound.lo is not None else 0
    middle = (lo + bound.hi) / 2 if bound.hi is not None else lo
    return next((_num(x) for x in (lo, lo + 1, middle) if bound.holds(x)), "1")


def validate_choices(job: JobConfig) -> list[Problem]:
    """Every choice field holds one of the values its schema declaration allows (null where nullable)."""
    problems = []
    for name, section, f in choice_fields(job):
        if not is_allowed(section, f.name):
            value, allowed = getattr(section, f.name), f.metadata["choices"]
            shown = ", ".join(map(str, allowed)) + (" (or null)" if f.metadata["nullable"] else "")
            problems.append(Problem(name, value, f"must be one of {shown}", f"{name}={closest_choice(value, allowed)}"))
    return problems


def closest_choice(value, allowed: tuple) -> str:
    """The allowed value nearest to a misspelt one (``1F1B`` -> ``1f1b``), else the first allowed value."""
    return meant(value, allowed) or str(allowed[0])


def meant(value, allowed) -> str | None:
    """The allowed value a misspelt one was probably meant as (another case, a close typo), or None."""
    names = [str(a) for a in allowed]
    folded = {n.lower(): n for n in names}
    if str(value).lower() in folded:
        return folded[str(value).lower()]
    near = difflib.get_close_matches(str(value), names, n=1, cutoff=0.75)
    return near[0] if near else None


def respelled_list(field: str, values: list, allowed: tuple) -> str:
    """For a list field with unknown names: ``field=[...] or `` with each unknown name as the name it was probably
    meant as (``[CORE_ATTN,mlp]`` -> ``[core_attn,mlp]``; names with no likely meaning dropped), or '' when no
    unknown name has one."""
    unknown = [v for v in values if v not in allowed]
    fixed = {v: meant(v, allowed) for v in unknown}
    if not any(fixed.values()):
        return ""
    spelled = [fixed[v] if v in fixed else v for v in values]
    return f"{field}=[{','.join(v for v in spelled if v)}] or "


def validate_sizes(job: JobConfig) -> list[Problem]:
    """Sizes so large that they can only be typos; checked before anything is derived, because the layout
    holds a table per layer and per (virtual) pipeline chunk."""
    c = Checks()
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
    c = Checks()
    for name, (cls, kind) in FIELD_TYPES.items():
        section, _, attr = name.rpartition(".")
        value = getattr(getattr(job, section) if section else job, attr)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if "float" in kind:
            c.need(math.isfinite(value), name, value, "must be a finite number", f"{name}={default_text(name)}")
        elif "int" in kind:  # Python ints are unbounded; torch and the index files hold 64 bits
            c.need(abs(value) < 2**63, name, value, "must fit in 64 bits", f"{name}={default_text(name)}")
    return c.problems


@lru_cache(maxsize=4096)
def divisor_near(n: int, want: int) -> int:
    """The divisor of n closest to want (ties go lower): a valid value to suggest."""
    n, want = max(1, int(n)), max(1, int(want))
    if n > 10**10:  # too many candidates to enumerate: the largest divisor of n that divides want
        return math.gcd(n, want)
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]  # O(sqrt n): hints are built eagerly
    divisors = small + [n // d for d in small]
    return min(divisors, key=lambda d: (abs(d - want), d))


def round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit if unit else x
