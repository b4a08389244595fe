"""Rules of the pipeline schedule: what 1F1B, interleaved and the zero-bubble schedules need of the layout, and
the zero-bubble executor's own rules (``zb_h1_rules``, ``zb_v_rules``), which the layout search reads too.
Login-node code.
"""
from __future__ import annotations

from launcher.core import Layout
from launcher.fields import is_allowed
from launcher.problems import Problem
from launcher.schema import JobConfig, Schedule
from launcher.validate.generic import Checks, round_up


def zb_h1_rules(job: JobConfig) -> list[tuple]:
    """What the zero-bubble executor (launcher/rank/zb_executor.py) trains, as (holds, field, value, rule, hint);
    validate_schedule checks them all, the layout search those on fields it does not choose itself. Recompute,
    MoE experts (with router and shared experts), MTP, overlap_grad_reduce and the distributed optimizer are
    supported (tests/test_zero_bubble.py: 1F1B's gradients, bitwise); what is refused here, upstream forbids.
    tp_comm_overlap is kept without the userbuffer overlaps TE forbids with delayed wgrad or that would hold W's
    operands (the rank sets them off: models/deferred_wgrad.py ZB_TP_OVERLAP, quoting TE)."""
    p, zb = job.parallel, f"{job.schedule.kind} (launcher/rank/zb_executor.py)"
    return [
        (p.pipeline > 1, "schedule.kind", job.schedule.kind, f"{job.schedule.kind} needs parallel.pipeline > 1",
         "parallel.pipeline=2 (or schedule.kind=1f1b)"),
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


ZB_V_COST_MIN, ZB_V_COST_MAX, ZB_V_COST_SPREAD = 1e-6, 1e6, 1e3
"""schedule.zb_v_costs' range: the list scheduler (launcher.core.pipeline.schedules._zb_v) adds costs into clocks and sums
6pm of them; inf, nan, or 1e308 (whose sum overflows to inf) leave it no finite makespan, and the planner and
render then have no order at all. Relative costs a thousand times apart, microseconds up to a second, all order."""


def zb_v_costs_in_range(costs) -> bool:
    """Every cost finite, within [ZB_V_COST_MIN, ZB_V_COST_MAX], the largest at most ZB_V_COST_SPREAD x the
    smallest."""
    import math

    values = [float(c) for c in costs]
    return all(math.isfinite(c) and ZB_V_COST_MIN <= c <= ZB_V_COST_MAX for c in values) and \
        max(values) <= ZB_V_COST_SPREAD * min(values)


def zb_v_rules(job: JobConfig, lay: Layout) -> list[tuple]:
    """ZB-V's own layout rules (launcher.core.pipeline.schedules.schedule_zb_v: two chunks per rank in a V, so rank 0
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
        # launcher.core.pipeline.schedules.zb_v_stage_costs: one triple for every stage, or one per stage (2 x PP of them)
        (job.schedule.zb_v_costs is None or (len(job.schedule.zb_v_costs) in (3, 6 * lay.pp)
                                              and zb_v_costs_in_range(job.schedule.zb_v_costs)),
         "schedule.zb_v_costs", job.schedule.zb_v_costs, f"relative chunk costs, each finite, in [{ZB_V_COST_MIN:g}, "
         f"{ZB_V_COST_MAX:g}] and within {ZB_V_COST_SPREAD:g}x of each other: three [T_F, T_B, T_W] for "
         f"every stage, or {6 * lay.pp} (one triple per pipeline stage 0..{2 * lay.pp - 1}, 2 x parallel.pipeline "
         "stages)", "schedule.zb_v_costs=null (equal costs) or schedule.zb_v_costs=[1,1,1]"),
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
         "layer on rank 0 in two model chunks; tying them there is not implemented (launcher/rank/zb_executor.py)",
         "model.tie_embeddings=false (or schedule.kind=interleaved)"),
    ]


def precision_fp8_without_biases(job: JobConfig) -> bool:
    """zb_h1 trains FP8 only without linear biases (TE's backward_dw, see zb_h1_rules)."""
    return job.precision.fp8 is None or not (job.model.add_bias_linear or job.model.add_qkv_bias)


def validate_schedule(job: JobConfig, lay: Layout) -> list[Problem]:
    c = Checks()
    s, p = job.schedule, job.parallel
    if not is_allowed(s, "kind"):
        return c.problems  # reported by validate_choices
    vp, m = lay.vpp, lay.microbatches
    if s.kind in Schedule.ZERO_BUBBLE and job.action not in ("plan", "search"):  # what the ZB executor supports
        for ok, field, value, rule, hint in zb_h1_rules(job):
            c.need(ok, field, value, rule, hint)
    if s.kind == Schedule.ZB_V:
        for ok, field, value, rule, hint in zb_v_rules(job, lay):
            c.need(ok, field, value, rule, hint)
    elif s.kind == Schedule.INTERLEAVED or (s.kind == Schedule.ZB_H1 and vp > 1):
        if s.kind == Schedule.INTERLEAVED:
            c.need(vp > 1 and p.pipeline > 1, "schedule.kind", s.kind,
                   "interleaved needs parallel.pipeline > 1 and parallel.virtual_pipeline > 1",
                   "parallel.virtual_pipeline=2 or schedule.kind=1f1b")
            c.need(not (p.pipeline == 2 and s.batch_p2p_comm and not s.overlap_p2p_comm), "schedule.batch_p2p_comm",
                   s.batch_p2p_comm, "interleaved with PP=2 and batched p2p trains silently wrong (Megatron-LM #750, "
                   "#1450)", "schedule.batch_p2p_comm=false or schedule.overlap_p2p_comm=true")
        # zb_h1 over a virtual pipeline runs Megatron's interleaved order of F and B (schedules._zb_h1_interleaved),
        # so it needs what that order needs
        group = lay.microbatch_group
        if m:
            c.need(m % group == 0, "train.global_batch_size", job.train.global_batch_size,
                   f"{s.kind} needs microbatches per step ({m}) divisible by the microbatch group size ({group})",
                   f"train.global_batch_size={round_up(m, group) * job.train.global_batch_size // m}")
    else:
        c.need(vp == 1, "parallel.virtual_pipeline", p.virtual_pipeline,
               f"virtual pipeline stages need schedule.kind=interleaved (got {s.kind})", "schedule.kind=interleaved")
        # megatron/training/arguments.py: "Setting args.overlap_p2p_comm ... to False" without a virtual pipeline;
        # our zero-bubble executor overlaps receives only over several chunks (launcher.core.pipeline.p2p.plan)
        c.need(not s.overlap_p2p_comm, "schedule.overlap_p2p_comm", True,
               "p2p overlap needs a virtual pipeline (interleaved, or zb_h1/zb_v with parallel.virtual_pipeline)",
               "schedule.overlap_p2p_comm=false")
    # the costs order zb_v's list scheduler only (launcher.core.pipeline.schedules.schedule_zb_v): any other kind ignores them
    c.need(s.zb_v_costs is None or s.kind == Schedule.ZB_V, "schedule.zb_v_costs", s.zb_v_costs,
           f"orders schedule.kind=zb_v only; {s.kind} ignores it", "schedule.zb_v_costs=null", severity="warning")
    if s.microbatch_group_size is not None:
        c.need(s.microbatch_group_size >= p.pipeline, "schedule.microbatch_group_size", s.microbatch_group_size,
               f"must be at least parallel.pipeline={p.pipeline}", f"schedule.microbatch_group_size={p.pipeline}")
    if p.pipeline > 1 and m:
        c.need(m >= p.pipeline, "train.global_batch_size", job.train.global_batch_size,
               f"only {m} microbatches for {p.pipeline} pipeline stages: the pipeline never fills (bubble > 50%)",
               f"train.global_batch_size={p.pipeline * job.train.global_batch_size // m}", severity="warning")
    return c.problems
