"""Layout search: enumerate valid TP/PP/VPP/CP/EP/schedule/micro-batch/recompute layouts, drop those that do not fit,
rank the rest by predicted throughput.

Candidates keep everything else of the job (model, precision, global batch, cluster, nodes). Each candidate's
``Layout`` is derived once, where it is built, and handed to the memory and time models with it; the fitting
ones are pre-ranked, and the best are checked with ``launcher.validate.validate`` (the same rules the launcher
enforces) and timed with the schedule simulator.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from launcher.core import Layout, derive
from launcher.plan import layout_errors
from launcher.core.flops import query_groups
from launcher.plan.memory import GB, cuda_graph_bytes, host_fits, memory_per_stage, stage_layers
from launcher.plan.timing import step_time, throughput, zb_v_costs_best, zb_v_costs_estimate
from launcher.schema import JobConfig, Recompute, Schedule
from launcher.problems import errors
from launcher.validate import validate
from launcher.validate.hints import problem_key
from launcher.validate.model import validate_activation_offload, validate_cuda_graphs
from launcher.validate.schedule import zb_h1_rules

MICRO_BATCH_SIZES = (1, 2, 4)
"""Micro-batch sizes tried."""
CONTEXT_SIZES = (1, 2, 4, 8)
"""Context-parallel sizes tried (GPU clusters only: CP needs Transformer Engine attention)."""
MAX_VIRTUAL = 8
"""Largest virtual-pipeline size tried, besides one layer per chunk (NVIDIA runs Qwen3-30B-A3B at PP2 x VP24)."""
MAX_ONE_LAYER_CHUNKS = 24
"""One decoder layer (or slot) per chunk is tried up to this many chunks per stage."""
RECOMPUTE = ("none", "selective", "full")
"""Recompute modes tried."""
STATIC_PARTS = ("weights", "grads", "optimizer", "fp8_weights", "reserve")
"""Memory parts that neither the micro batch nor recomputation changes."""
GRAPH_MODULES = {True: (["attn", "moe_router", "moe_preprocess"], ["attn", "moe_router"], ["attn"]),
                 False: ([], ["attn", "mlp"])}
"""train.cuda_graph_modules tried, first valid one wins, for an MoE (True) or a dense (False) model when the job has
no CUDA graphs: NVIDIA's MoE scope (Megatron-Bridge's DeepSeek-V3 / GPT-OSS / Qwen3-30B recipes: attn, moe_router,
moe_preprocess; the dropless expert part cannot be captured), and the whole dense layer."""
MODULE_RECOMPUTE = {"mla": ("mla_up_proj", "mlp"), "moe": ("moe_act", "layernorm")}
"""Per-module selective recomputation tried besides core attention: NVIDIA's DeepSeek-V3 H100 choice for MLA
models; the cheap output-discarding pair for MoE models."""
OFFLOAD_MODULES = {"dense": ("qkv_linear", "core_attn", "attn_proj"), "moe": ("expert_fc1", "moe_act")}
"""train.activation_offload_modules the search tries without recompute. Dense: the attention inputs every layer of
the TE spec offloads (validate_activation_offload: the norms are fused into the linears). MoE: the routed experts'
inputs, the bulk of an MoE layer's activations (top-k copies of each token), which stay outside the CUDA-graph
scopes the search pairs with MoE layouts (GRAPH_MODULES: offloading inside the attention graph needs TE >= 2.14,
the image has 2.7), so an offloading MoE candidate keeps its graphed twin."""


@dataclass
class Candidate:
    """One ranked layout."""

    overrides: list[str]
    """Command-line overrides that turn the job into this layout."""
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    step_s: float
    peak_gb: float
    gpu_memory_gb: float
    bubble_fraction: float
    why: str
    """One line: why this layout ranks where it does."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _with(job: JobConfig, **sections) -> JobConfig:
    """A copy of job with some fields of some sections replaced: _with(job, parallel={...}, train={...}).

    What ``dataclasses.replace`` gives (a shallow copy with the fields set, ``__post_init__`` run again), without
    its re-run of ``__init__`` over every field: the search builds tens of thousands of candidates, and replace was
    its largest single cost (Qwen3-30B on 16 H100s: 55,000 calls, 15% of the search)."""
    out = _copy(job)
    for name, vals in sections.items():
        section = _copy(getattr(job, name))
        known = _field_names(type(section))
        for key, value in vals.items():
            if key not in known:
                raise TypeError(f"{type(section).__name__} has no field {key!r}")  # as replace would
            setattr(section, key, value)
        if hasattr(section, "__post_init__"):
            section.__post_init__()
        setattr(out, name, section)
    return out


def _copy(obj):
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    return new


@functools.lru_cache(maxsize=None)
def _field_names(cls) -> frozenset:
    return frozenset(f.name for f in dataclasses.fields(cls))


def candidates(job: JobConfig, base: Layout | None = None, skip=None):
    """Yield (overrides, candidate job, its Layout) for every layout worth checking (``base``: the job's own
    layout, derived if None; ``skip(layout, batch)``: True for a layout (its overrides, a tuple; ``batch`` None)
    or a layout and micro batch (``batch``: the micro batch override) whose candidates the caller drops whatever
    the recomputation: those are not built)."""
    model, cl = job.model, job.cluster
    base = base or derive(job)  # world and TE do not change between candidates
    world, te = base.world, base.transformer_engine
    # the job's all-to-all overlap, kept where a layout allows it (never switched on by the search: NVIDIA's two
    # overlapped dropless Qwen3-30B H100 runs, 25.11 and 26.02, measured half of the non-overlapped ones,
    # Megatron-Bridge #1998, and its B200 recipes drop it for "CPU overhead"; the planner prices that host time by one
    # constant fitted on one of those runs, host.OVERLAP_HOST_PER_EXPERT_S, too thin to choose the overlap by)
    fixed = _JobFacts(overlap=job.parallel.moe_a2a_overlap and _moe_overlap_possible(job, te),
                      recomputes=_recompute_options(job, te))
    heads = model.num_attention_heads
    groups = query_groups(model)
    tps = [t for t in _divisors(cl.gpus_per_node) if heads % t == 0 and groups % t == 0]
    cps = [c for c in CONTEXT_SIZES if c == 1 or (te and model.seq_length % (2 * c) == 0)]
    eps = [1]
    if model.num_experts:
        eps = [e for e in _divisors(model.num_experts) if e <= 64]
    for tp in tps:
        for cp in cps:
            if world % (tp * cp):
                continue
            for pp in _divisors(world // (tp * cp)):
                for split, vps in _splits(job, pp, base):
                    for vp in vps:
                        for ep in eps:
                            for etp in _expert_tensor_sizes(job, tp):
                                for fsdp in ((False, True) if pp == 1 and te and not model.num_experts else (False,)):
                                    yield from _batch_and_recompute(job, fixed, tp, cp, pp, vp, ep, split, fsdp, etp,
                                                                    skip)


def _expert_tensor_sizes(job: JobConfig, tp: int) -> list:
    """Expert tensor parallel sizes worth trying with TP = ``tp``: 1 (NVIDIA's MoE recipes) and TP itself
    (Megatron-Core's default when unset); [None] (not set) for a dense model. Validation drops the ones
    Megatron-Core refuses (an expert FFN ETP does not divide, linear biases)."""
    return sorted({1, tp}) if job.model.num_experts else [None]


EVEN = {"first_stage_layers": None, "last_stage_layers": None, "account_for_embedding_in_pipeline_split": False,
        "account_for_loss_in_pipeline_split": False, "pipeline_model_parallel_layout": None}
"""The split fields of an even split (every candidate sets all of them)."""


def _splits(job: JobConfig, pp: int, base: Layout) -> list[tuple[dict, list[int]]]:
    """(split fields, virtual sizes) worth trying at ``pp`` stages: the even split, the embedding and loss
    counted as layers (NVIDIA's way for 126 or 94 layers), and the job's own uneven or explicit split."""
    layers, par = job.model.num_layers, job.parallel
    if pp == 1:
        return [(EVEN, [1])]
    out = []
    if layers % pp == 0 and pp <= layers:
        out.append((EVEN, _even_virtual_sizes(layers // pp)))
    if (layers + 2) % pp == 0 and pp <= layers:
        account = dict(EVEN, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
        out.append((account, _even_virtual_sizes((layers + 2) // pp)))
    if pp == par.pipeline and par.pipeline_model_parallel_layout:
        own = dict(EVEN, pipeline_model_parallel_layout=par.pipeline_model_parallel_layout)
        out.append((own, [base.vpp]))
    elif pp == par.pipeline and (par.first_stage_layers, par.last_stage_layers) != (None, None):
        first, last = par.first_stage_layers, par.last_stage_layers
        own = dict(EVEN, first_stage_layers=first, last_stage_layers=last)
        out.append((own, _virtual_sizes(layers, pp, first, last)))
    return out


def _even_virtual_sizes(per_stage: int) -> list[int]:
    """Chunks per stage that divide its ``per_stage`` layer slots: up to MAX_VIRTUAL, and one slot per chunk."""
    out = [v for v in range(1, MAX_VIRTUAL + 1) if per_stage % v == 0]
    if MAX_VIRTUAL < per_stage <= MAX_ONE_LAYER_CHUNKS:
        out.append(per_stage)
    return out


def _virtual_sizes(layers: int, pp: int, first, last) -> list[int]:
    """Virtual sizes of a first/last-stage override split (each stage's layers divide into VP chunks)."""
    out = [1]
    for v in range(2, MAX_VIRTUAL + 1):
        if all(x is None or x % v == 0 for x in (first, last)):
            middle = pp - (first is not None) - (last is not None)
            rest = layers - (first or 0) - (last or 0)
            if middle and rest % (middle * v) == 0:
                out.append(v)
    return out


def _split_overrides(split: dict) -> list[str]:
    def val(v):
        return "null" if v is None else ("true" if v is True else "false" if v is False else
                                         f"'{v}'" if isinstance(v, str) else str(v))
    return [f"parallel.{k}={val(v)}" for k, v in split.items()]


@dataclass(frozen=True)
class _JobFacts:
    """What every candidate of one search shares, worked out once."""

    overlap: bool
    """The job's MoE all-to-all overlap, where Megatron-Core allows it for the model (layouts checked apart)."""
    recomputes: list
    """(train.recompute, train.recompute_modules) pairs tried."""


def _moe_overlap_possible(job: JobConfig, te: bool) -> bool:
    """Megatron-Core's layout-independent conditions for overlap_moe_expert_parallel_comm (EP > 1 and VP with PP
    are checked per layout, recompute per candidate)."""
    m = job.model
    return (bool(m.num_experts) and m.moe_token_dispatcher_type in ("alltoall", "flex")
            and job.precision.dtype in ("bf16", "fp16") and (m.mtp_num_layers or 0) <= 1 and te)


def _recompute_options(job: JobConfig, te: bool) -> list[tuple[str, list, list]]:
    """(train.recompute, train.recompute_modules, train.activation_offload_modules), cheapest first: the search
    keeps the first that fits a layout. Activation offloading (``OFFLOAD_MODULES``, without recompute; a GPU with
    Transformer Engine, not beside local CUDA graphs) comes after selective recompute and before full recompute:
    the planner prices its copies as hidden behind compute, a figure read from the code and not yet measured,
    where selective recompute's cost rests on NVIDIA's published rows; so it is offered where the alternative is
    recomputing whole layers (a forward pass more), not in place of a measured cheap recompute (before that
    ordering, an offloading PP2 x EP8 layout at mbs 4 ranked 15% above every layout NVIDIA published for
    Qwen3-30B-A3B on 16 H100s, on the grouped-GEMM efficiency curve extrapolated to twice the tokens)."""
    out = [("none", [], []), ("selective", [], [])]
    if job.model.multi_latent_attention:
        out.append(("selective", list(MODULE_RECOMPUTE["mla"]), []))
    elif job.model.num_experts and job.model.moe_grouped_gemm and te \
            and job.precision.fp8 != "delayed":  # Megatron refuses these two with delayed FP8 scaling
        out.append(("selective", list(MODULE_RECOMPUTE["moe"]), []))
    if job.cluster.gpu != "cpu" and te and job.train.cuda_graph_impl != "local":
        out.append(("none", [], list(OFFLOAD_MODULES["moe" if job.model.num_experts else "dense"])))
    return out + [("full", [], [])]


CHOSEN_FOR_ZB_H1 = {"schedule.kind", "parallel.moe_a2a_overlap"}
"""Fields of launcher.validate.zb_h1_rules the search sets itself for a zero-bubble candidate (PP > 1; no
combined-1F1B MoE overlap). Recompute, overlap_grad_reduce and tp_comm_overlap stay the job's (or the search's
own choice): under zero bubble the rank keeps the userbuffer overlaps TE allows with deferred weight gradients
(models/deferred_wgrad.py zb_tp_overlap) and the planner prices the rest (timing._overlapped_tp)."""


def _zb_h1_allowed(job: JobConfig) -> bool:
    """What launcher/rank/zb_executor.py trains, on the fields the search keeps from the job (validation skips
    the ZB-H1 rules for action=search, so this is the search's own check)."""
    return all(ok for ok, field, *_ in zb_h1_rules(job) if field not in CHOSEN_FOR_ZB_H1)


def _schedules(job: JobConfig, pp: int, vp: int) -> list[str]:
    """Schedules tried at this layout: the schedule is a search dimension (1F1B and ZB-H1 for an
    uninterleaved pipeline; interleaved and ZB-H1 over the same chunks for VPP > 1, and ZB-V beside them for
    VPP = 2)."""
    if vp > 1:
        if not _zb_h1_allowed(job):
            return [Schedule.INTERLEAVED]
        return [Schedule.INTERLEAVED, Schedule.ZB_H1] + ([Schedule.ZB_V] if vp == 2 else [])
    if pp > 1 and _zb_h1_allowed(job):
        return [Schedule.ONE_F_ONE_B, Schedule.ZB_H1]
    return [Schedule.ONE_F_ONE_B]


def _batch_and_recompute(job, fixed, tp, cp, pp, vp, ep, split, fsdp=False, etp=None, skip=None):
    for kind in _schedules(job, pp, vp):
        if kind == Schedule.ZB_V and split != EVEN:  # validate.zb_v_rules: the V splits the layers evenly
            continue
        yield from _batch_and_recompute_for(job, fixed, kind, tp, cp, pp, vp, ep, split, fsdp, etp, skip)


def _batch_and_recompute_for(job, fixed, kind, tp, cp, pp, vp, ep, split, fsdp=False, etp=None, skip=None):
    zb = kind in Schedule.ZERO_BUBBLE
    par = dict(tensor=tp, pipeline=pp, virtual_pipeline=vp if vp > 1 else None, context=cp, expert=ep,
               sequence_parallel=tp > 1, distributed_optimizer=True, data=None, megatron_fsdp=fsdp, **split)
    if job.model.num_experts:
        par["expert_tensor"] = etp
    overlap = fixed.overlap and ep > 1 and (pp == 1 or vp > 1) and not zb  # what this layout allows of it
    overlap_p2p = vp > 1  # interleaved, and the zero-bubble executor over several chunks (p2p.plan)
    sched = dict(kind=kind, overlap_p2p_comm=overlap_p2p,
                 batch_p2p_comm=job.schedule.batch_p2p_comm and not (kind == Schedule.INTERLEAVED and pp == 2),
                 microbatch_group_size=None)
    layout = [f"parallel.tensor={tp}", f"parallel.pipeline={pp}",
              f"parallel.virtual_pipeline={vp if vp > 1 else 'null'}", f"parallel.context={cp}"]
    if job.model.num_experts:
        layout += [f"parallel.expert={ep}", f"parallel.expert_tensor={etp}"]
    layout += [f"parallel.sequence_parallel={'true' if tp > 1 else 'false'}",
               "parallel.distributed_optimizer=true", *_split_overrides(split),
               f"parallel.megatron_fsdp={'true' if fsdp else 'false'}",
               f"schedule.kind={kind}",
               f"schedule.overlap_p2p_comm={'true' if overlap_p2p else 'false'}"]
    cluster = {}
    if fsdp and job.cluster.env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":  # FSDP needs more than one queue
        cluster = dict(env={**job.cluster.env, "CUDA_DEVICE_MAX_CONNECTIONS": "8"})
        layout.append("cluster.env.CUDA_DEVICE_MAX_CONNECTIONS=8")
    recomputes = fixed.recomputes
    # a zb_v candidate's own costs are among its overrides (and in the caller's keys): no skipping before they are
    skip = None if kind == Schedule.ZB_V else skip
    layout_key = tuple(layout)
    for mbs in MICRO_BATCH_SIZES:
        if skip is not None and skip(layout_key, None):
            continue
        sized = _with(job, parallel=par, schedule=sched, train=dict(micro_batch_size=mbs), **(
            {"cluster": cluster} if cluster else {}))
        lay = derive(sized)  # recomputation does not change the layout: one derivation serves all of them
        # The batch must split into micro-batches over DP, and ETP x EP must tile each stage's ranks.
        if not lay.microbatches or not lay.expert_dp:
            continue
        if kind == Schedule.ZB_H1 and vp > 1 and lay.microbatches % lay.microbatch_group:
            continue  # its order is interleaved's, which needs whole microbatch groups (validate refuses it)
        batch = f"train.micro_batch_size={mbs}"
        for rec, mods, off in recomputes:
            if skip is not None and skip(layout_key, batch):
                continue
            if off and zb:  # the offload manager follows Megatron-Core's own schedules (validate_activation_offload)
                continue
            a2a = overlap and rec != "full" and "moe" not in mods
            cand = _with(sized, train=dict(recompute=rec, recompute_modules=mods, activation_offload_modules=off),
                         parallel=dict(par, moe_a2a_overlap=a2a))
            extra = [f"train.recompute_modules=[{','.join(mods)}]"]
            if off or job.train.activation_offload_modules:
                extra.append(f"train.activation_offload_modules=[{','.join(off)}]")
            if job.model.num_experts:
                extra.append(f"parallel.moe_a2a_overlap={'true' if a2a else 'false'}")
            if kind == Schedule.ZB_V:  # the V's order generated for this candidate's own chunk costs
                costs = zb_v_costs_estimate(cand, lay, decimals=1)
                cand = _with(cand, schedule=dict(zb_v_costs=costs))
                extra.append(f"schedule.zb_v_costs=[{','.join(f'{c:g}' for c in costs)}]")
            yield layout + [f"train.micro_batch_size={mbs}", f"train.recompute={rec}"] + extra, cand, lay


def search(job: JobConfig, top: int = 10, layout: Layout | None = None,
           problems: list | None = None) -> list[Candidate]:
    """The ``top`` fitting layouts for job.model on job.nodes x gpus_per_node, fastest first (``layout``: the job's
    own layout, derived if None; ``problems``: the job's own validation, validated here if None).

    Candidates are valid by construction; memory is predicted for all of them, the fitting ones are
    pre-ranked with the closed-form bubble, then the best few are re-timed with the schedule simulator and
    checked with ``launcher.validate.validate`` (the launcher's own rules) before they are returned."""
    cap = job.cluster.gpu_memory_gb * GB
    fitting = []
    fitted: set = set()  # layouts (all but recompute) that already fit with less recomputation
    statics: dict = {}  # per parallel layout: its split and static bytes (micro batch and recompute do not change them)
    hopeless: set = set()  # parallel layouts whose static bytes alone exceed the GPU
    graphs = _GraphChoice(job, layout or derive(job))
    # a candidate may keep the job's own errors, not add others
    job_errors = {problem_key(p) for p in errors(validate(job) if problems is None else problems)}
    def dropped(layout_key: tuple, batch) -> bool:  # what the checks below drop, told before a candidate is built
        return layout_key in hopeless or (batch is not None and layout_key + (batch,) in fitted)

    for overrides, cand, lay in candidates(job, layout, skip=dropped):
        key = tuple(o for o in overrides if not o.startswith(("train.recompute=", "train.recompute_modules=",
                                                               "parallel.moe_a2a_overlap=",
                                                               "train.activation_offload_modules=")))
        if key in fitted:
            continue  # more recomputation than needed is never faster
        layout_key = tuple(o for o in key if not o.startswith("train.micro_batch_size="))
        if layout_key in hopeless:
            continue
        static = statics.setdefault(layout_key, {})
        # zero bubble: a bound on its op list's states first (zb_states.zb_v_bound_states, zb_h1_bound_states); the op
        # list itself only where the bound does not fit, and for the candidates returned (their printed peak): the
        # same fits, a fraction of the time (generating the order at 512 microbatches took up to 0.9 s a candidate)
        stages = memory_per_stage(cand, lay, static, zb_exact=False)
        if max(sum(s.parts[k] for k in STATIC_PARTS) for s in stages) > cap:
            hopeless.add(layout_key)  # weights, grads and optimizer alone do not fit: no batch or recompute helps
            continue
        peak = max(s.total for s in stages)
        if not host_fits(cand, stages):
            continue  # the node cannot pin what its ranks offload
        exact = peak > cap and cand.schedule.kind in Schedule.ZERO_BUBBLE
        if exact and cand.schedule.kind == Schedule.ZB_H1 and max(
                s.total for s in memory_per_stage(cand, lay, static, zb_exact="reached")) > cap * (1 + REACHED_MARGIN):
            continue  # states its op list certainly reaches already exceed the GPU: the exact peak would too
        if exact:
            peak = _exact_peak(cand, lay, static)
        if peak <= cap:
            fitted.add(key)
            st = step_time(cand, lay, exact=False)
            fitting.append((overrides, cand, lay, peak, st.step_s, static, exact, None))
            twin = _graph_twin(cand, lay, stages, st, graphs, cap)
            if twin is not None:  # the same layout with CUDA graphs switched the other way
                twin_overrides, twin_job, _, twin_peak, twin_st = twin
                saved = st.breakdown_s.get("host", 0.0) - twin_st.breakdown_s.get("host", 0.0)
                fitting.append((overrides + twin_overrides, twin_job, lay, twin_peak, twin_st.step_s, static, exact,
                                saved if twin_job.train.cuda_graph_impl != "none" else None))
    fitting.sort(key=lambda x: x[4])
    results: list[Candidate] = []
    tied_twin_shown = False
    for overrides, cand, lay, peak, _, static, exact, host_saved in fitting:
        if len(results) >= max(2 * top, 12):
            break
        if host_saved is not None and host_saved <= 0:  # graphs that save no host time here: memory for nothing
            if tied_twin_shown:  # shown once (what they would cost), not beside every layout, crowding the others out
                continue
            tied_twin_shown = True
        problems = validate(cand)
        if layout_errors(problems) or _new_errors(problems, job_errors):
            continue
        st = step_time(cand, lay)
        if cand.schedule.kind == Schedule.ZB_V:  # per-stage costs where the planner times their order shorter
            costs, tuned = zb_v_costs_best(cand, lay, decimals=1, own=st)
            other = _with(cand, schedule=dict(zb_v_costs=costs)) if costs != cand.schedule.zb_v_costs else None
            other_peak = _exact_peak(other, lay, static) if other is not None else None
            if other is not None and other_peak <= cap:  # another order holds other states: kept only if it fits
                cand, st, exact, peak = other, tuned, True, other_peak
                overrides = [o for o in overrides if not o.startswith("schedule.zb_v_costs=")] + [
                    f"schedule.zb_v_costs=[{','.join(f'{c:g}' for c in costs)}]"]
        perf = throughput(cand, st, lay)
        if cand.schedule.kind in Schedule.ZERO_BUBBLE and not exact:  # the printed peak: from the op list run
            peak = _exact_peak(cand, lay, static)
        results.append(Candidate(overrides, perf["tokens_per_s"], perf["tflops_per_gpu"], perf["mfu"], st.step_s,
                                 peak / GB, job.cluster.gpu_memory_gb, st.bubble_fraction,
                                 _why(cand, lay, st, peak, cap, host_saved)))
    results.sort(key=lambda c: -c.tokens_per_s)  # stable: at equal speed a layout's eager line before its graphed one
    return results[:top]


def _new_errors(problems, job_errors: set) -> list:
    """A candidate's errors that the job itself does not have: what the search's own choices (recompute, offload,
    graphs, FSDP's queues, ...) broke beyond the layout rules, so it is not returned. The job's own (a missing data
    path, a secret unset) are the job's, not the candidate's."""
    return [p for p in errors(problems) if problem_key(p) not in job_errors]


class _GraphChoice:
    """CUDA graphs as a search dimension: for a job without them, the graphed setting tried beside each fitting
    candidate (TE's make_graphed_callables where the job has Transformer Engine layers, else Megatron-Core's local
    graphs; ``GRAPH_MODULES``); for a job with them, the eager one. Whether Megatron-Core (and our executor) take
    the graphs at a candidate's schedule, recompute, FSDP and overlap is ``validate_cuda_graphs``' answer, asked
    once per combination of those."""

    def __init__(self, job: JobConfig, lay: Layout):
        self.own = job.train.cuda_graph_impl
        self.impl = "transformer_engine" if lay.transformer_engine else "local"
        self.options = GRAPH_MODULES[bool(job.model.num_experts)]
        self.allowed = job.cluster.gpu != "cpu"
        self._cache: dict = {}

    def settings(self, cand: JobConfig, lay: Layout):
        """(train fields, overrides) of the other setting for ``cand``, or None where it is refused."""
        if self.own != "none":
            return dict(cuda_graph_impl="none", cuda_graph_modules=[]), [
                "train.cuda_graph_impl=none", "train.cuda_graph_modules=[]"]
        if not self.allowed:
            return None
        t, par = cand.train, cand.parallel
        key = (cand.schedule.kind, t.recompute, tuple(t.recompute_modules), par.megatron_fsdp, par.moe_a2a_overlap,
               tuple(t.activation_offload_modules))
        if key not in self._cache:  # the graphs' own rules, and activation offloading's beside graphs
            def refused(mods) -> bool:
                graphed = _with(cand, train=dict(cuda_graph_impl=self.impl, cuda_graph_modules=mods))
                return any(p.severity == "error" for p in
                           validate_cuda_graphs(graphed, lay) + validate_activation_offload(graphed, lay))
            self._cache[key] = next((mods for mods in self.options if not refused(mods)), None)
        mods = self._cache[key]
        if mods is None:
            return None
        return dict(cuda_graph_impl=self.impl, cuda_graph_modules=list(mods)), [
            f"train.cuda_graph_impl={self.impl}", f"train.cuda_graph_modules=[{','.join(mods)}]"]


def _graph_twin(cand: JobConfig, lay: Layout, stages, st, graphs: _GraphChoice, cap: float):
    """(overrides, job, layout, peak, StepTime) of ``cand`` with CUDA graphs switched the other way, if that is
    allowed and fits. Memory: each stage's total with its graph buffers swapped (``cuda_graph_bytes``, additive);
    time: graphs change only the host term, so a candidate with no host time exposed keeps its step time when
    graphs remove host work (no re-timing)."""
    other = graphs.settings(cand, lay)
    if other is None:
        return None
    fields, overrides = other
    twin = _with(cand, train=fields)
    pattern = lay.moe_pattern
    peak = 0.0
    for r, s in enumerate(stages):  # the decoder layers' graphs, as memory.stage_memory counts them
        layers = stage_layers(lay, r)
        n_moe = sum(1 for i in layers if pattern[i])
        peak = max(peak, s.total - s.parts.get("cuda_graphs", 0.0) + cuda_graph_bytes(twin, lay, len(layers) - n_moe,
                                                                                     n_moe))
    if peak > cap:
        return None
    removes_host = fields["cuda_graph_impl"] != "none"
    twin_st = st if removes_host and not st.breakdown_s.get("host", 0.0) else step_time(twin, lay, exact=False)
    return overrides, twin, lay, peak, twin_st


def _exact_peak(job: JobConfig, lay: Layout, static: dict) -> float:
    """The peak from the op list the ranks run (``memory_per_stage`` exact)."""
    return max(s.total for s in memory_per_stage(job, lay, static))


REACHED_MARGIN = 1e-9
"""How far (relative) the peak over ``zb_states.zb_h1_reached_states`` must exceed the GPU before the search drops a
ZB-H1 candidate without its exact peak: the exact peak is a max over a superset of those states, so it is at least
as large, up to float rounding of the per-part sums (relative 1e-16); the margin keeps the skip decision exactly
the one the exact peak would make."""


TIGHT_FIT = 0.95
"""A candidate predicted above this share of the GPU's memory says so in its "why" line: the planner's peak is
an estimate (within a few percent of Megatron-Core's allocations on CPU), and allocator fragmentation is not in it."""


def _why(job: JobConfig, lay: Layout, st, peak: float, cap: float, host_saved: float | None = None) -> str:
    """One line: what this candidate's peak, bubble, recompute, exposed communication and CUDA graphs cost
    (``host_saved``: host time its graphs save against the same layout eager, when the search switched them on)."""
    tr = job.train
    bits = [f"fits {peak / GB:.1f}/{cap / GB:.0f} GB"]
    if peak > TIGHT_FIT * cap:  # the reserve covers the CUDA context and NCCL; fragmentation can take more
        bits.append(f"only {(cap - peak) / GB:.1f} GB free beyond cluster.memory_reserve_gb="
                    f"{job.cluster.memory_reserve_gb:g} (raise it to ask for headroom)")
    if lay.pp > 1:
        bits.append(f"bubble {100 * st.bubble_fraction:.0f}%")
    if tr.recompute != Recompute.NONE:
        bits.append(f"recompute {tr.recompute} costs {st.breakdown_s.get('recompute', 0):.2f} s")
    if tr.activation_offload_modules:  # what the offloaded activations hold on the host and the copies' exposed time
        host = max(s.host.get("activations", 0.0) for s in memory_per_stage(job, lay))
        bits.append(f"activation offload holds {host / GB:.1f} GB of host memory, PCIe time exposed "
                    f"{st.breakdown_s.get('offload', 0.0):.2f} s (read from the code, not yet measured)")
    comm = {k: st.breakdown_s.get(k, 0.0) for k in ("tp_comm", "cp_comm", "ep_comm", "dp_comm")}
    worst = max(comm, key=comm.get)
    if comm[worst] > 0.01 * st.step_s:
        bits.append(f"{worst} {comm[worst]:.2f} s exposed")
    if lay.tp * lay.cp > job.cluster.gpus_per_node:
        bits.append("TPxCP crosses nodes")
    if tr.cuda_graph_impl != "none":  # what the graphs cost in memory and what host time is left exposed
        graphs = max(s.parts.get("cuda_graphs", 0.0) for s in memory_per_stage(job, lay))
        saved = "" if host_saved is None else f", {host_saved:.2f} s less than eager"
        bits.append(f"CUDA graphs ({tr.cuda_graph_impl}) hold {graphs / GB:.1f} GB, "
                    f"host time exposed {st.breakdown_s.get('host', 0.0):.2f} s{saved}")
    bits.append(f"mbs {tr.micro_batch_size}")
    return "; ".join(bits)
