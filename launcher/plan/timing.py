"""Step time: compute from FLOPs per GPU, exposed TP/CP/EP/DP/PP communication, and the pipeline bubble.
One room (~630 lines): the terms of one layer pass's cost are read together, each beside the overlap that hides it.

Per pipeline stage and microbatch the planner builds three costs, F (forward), B (input gradient) and
W (weight gradient), each = GEMM FLOPs / (peak x cluster.gemm_efficiency) [FP8 peak for the layer GEMMs
under FP8] + core-attention FLOPs / (BF16 peak x gemm_efficiency) + element-wise traffic / (HBM x
HBM_EFFICIENCY) + exposed tensor/context/expert-parallel communication. Those costs go through the schedule
simulator (``simulator.py``) with the pipeline send/recv time as the dependency latency: its makespan is the
pipelined part of the step, bubble included. Data-parallel gradient reduce-scatter / parameter all-gather
(exposed part) and the optimizer step come on top. Overlap rules and constants: ``launcher/plan/NOTES.md``.
Pure Python: no torch, no megatron.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from launcher.core import Layout, derive
from launcher.core.flops import FMA, flops_per_step, kv_channels, layer_flops, query_groups
from launcher.plan.memory import (DTYPE_BYTES, GRAD_BYTES_FP32, fsdp_layer_params, grad_groups, main_param_bytes,
                                  offloaded_bytes_per_token, optimizer_shards, param_bytes, recompute_fraction,
                                  recomputed_modules, sp_shards, stage_layers, stage_params)
from launcher.core.pipeline.schedules import loss_rank
from launcher.plan.host import host_seconds, overlap_host_seconds
from launcher.plan.measured import op_overhead, shared_units_s
from launcher.plan.simulator import simulate_kind
from launcher.schema import JobConfig, Recompute, Schedule

HBM_EFFICIENCY = 0.8
"""Fraction of HBM bandwidth that element-wise kernels (norms, SwiGLU, RoPE, residual adds) reach."""
ELEMENTWISE_PASSES_BWD = 2.0
"""Backward element-wise traffic relative to forward (reads the saved input and the incoming gradient)."""
COLLECTIVE_LATENCY_S = 20e-6
"""Fixed cost per collective / send (launch + NCCL latency), added to bandwidth time."""
ATTENTION_BWD_FACTOR = 2.5
"""Flash-attention backward time / forward time (recomputes the scores; FlashAttention-2 paper: 2.5x)."""
ATTENTION_HALF_SEQ = 256
"""Query-block length at which flash attention runs at half its long-sequence rate: its efficiency is
L / (L + 256) for blocks of L tokens (FlashAttention-2 paper, Fig. 4-7: causal head-dim 128 forward reaches
~58% of its 16k rate at 512, ~90% at 2k). With context parallelism a ring step works on blocks of s / (2 CP)."""
CP_STEP_OVERHEAD_S = 200e-6
"""Fixed cost per context-parallel ring step per attention layer per pass (P2P launch and wait, the
output/LSE correction kernels of TE's ring attention); fitted, see NOTES.md."""
MOE_LAYER_OVERHEAD_S = 1.25e-3
"""Fixed cost per MoE layer per pass beyond its FLOPs and bytes: router top-k, the dispatcher's token-count
exchange and host sync, permutation index building, per-expert kernel launches; fitted, see NOTES.md."""
GROUPED_GEMM_HALF_TOKENS = 4096
"""Tokens per local expert at which the grouped expert GEMMs run at half the dense GEMM efficiency (they
reach it as n / (n + GROUPED_GEMM_HALF_TOKENS) for n tokens per expert); fitted, see NOTES.md (weakly
identified: every published MoE row has 4,096 tokens per local expert)."""
BLOCKWISE_FP8_TIME = 22.882 / 20.285
"""Layer FP8 GEMMs + their casts under blockwise FP8 (TE ``Float8BlockScaling``: 1x128 / 128x128 blocks, scales
applied in cuBLAS's main loop) over per-tensor current scaling. Not fitted: TE's GEMM profiling guide
(NVIDIA/TransformerEngine ``docs/examples/gemm_profiling/gemm_profiling.rst``, #2863, "Worked Example: 5B Model on
H200", autocast = GEMM + quantisation): 22.882 ms per layer FP8Block vs 20.285 ms FP8Current, H200 NVL. Every
blockwise job (validation allows it on Hopper only, where TE runs it natively)."""
H100_SMS = 132
"""Streaming multiprocessors of an H100 / H200 SXM (the profiles' GPUs)."""
A2A_SM_SHARE = 20 / H100_SMS
"""Share of the GPU's SMs the flex dispatcher's all-to-all kernels (DeepEP, HybridEP) occupy while they run
beside computation under parallel.moe_a2a_overlap: DeepEP's default of 20 SMs (Megatron-Core
``moe_deepep_num_sms``, "historical default 20"; HybridEP "uses the default from DeepEP") of 132; NVIDIA's MoE
recipes likewise keep 16-20 SMs free for communication kernels (``NVTE_FWD/BWD_LAYERNORM_SM_MARGIN``). Not fitted."""
NCCL_A2A_SM_SHARE = 32 / H100_SMS
"""The same share for the alltoall dispatcher, whose exchanges are NCCL kernels: NCCL runs a
send/recv batch as one CTA per p2p channel, and on 8-GPU H100 nodes it sets up 32 p2p channels (its init log
"... 32 p2p channels, 32 p2p channels per peer"; ``MAX_P2P_NCHANNELS`` defaults to ``MAXCHANNELS``). Not fitted."""


@dataclass
class StageCosts:
    """Per-microbatch times (s) of one pipeline stage on one rank, and what they are made of."""

    f: float
    b: float
    w: float
    parts: dict = field(default_factory=dict)
    """Seconds per microbatch by contributor (gemm, attention, elementwise, tp_comm, cp_comm, ep_comm, recompute)."""


@dataclass
class StepTime:
    """Predicted time of one optimizer step and its breakdown (seconds)."""

    step_s: float
    """Whole step."""
    pipeline_s: float
    """Makespan of the pipeline schedule (compute + exposed TP/CP/EP/PP comm + bubble)."""
    bubble_s: float
    """Idle time of the busiest stage inside the pipeline makespan."""
    bubble_fraction: float
    """Idle share of rank-time in the schedule."""
    dp_exposed_s: float
    """Data-parallel gradient reduce-scatter + parameter all-gather not hidden behind compute."""
    optimizer_s: float
    """Optimizer step (memory-bound)."""
    breakdown_s: dict = field(default_factory=dict)
    """Seconds per step summed over microbatches on the busiest stage, by contributor."""
    stages: list = field(default_factory=list)
    """Per-stage (F, B, W) seconds per microbatch."""

    def to_dict(self) -> dict:
        return {"step_s": self.step_s, "pipeline_s": self.pipeline_s, "bubble_s": self.bubble_s,
                "bubble_fraction": self.bubble_fraction, "dp_exposed_s": self.dp_exposed_s,
                "optimizer_s": self.optimizer_s, "breakdown_s": self.breakdown_s,
                "stages_fbw_s": self.stages}


# ------------------------------------------------------------------------------------------- topology
def _link_bandwidth(cl, network: bool) -> float:
    """Bytes/s per GPU over the network or over NVLink, at the share of the line rate each reaches."""
    if network:
        return cl.network_bandwidth_gbps * 1e9 * cl.network_efficiency
    return cl.nvlink_bandwidth_gbps * 1e9 * cl.comm_efficiency


def _bandwidth(job: JobConfig, span: int) -> float:
    """Bytes/s per GPU for a group whose members lie within ``span`` consecutive ranks."""
    return _link_bandwidth(job.cluster, span > job.cluster.gpus_per_node)


def _ring(nbytes: float, n: int, bw: float) -> float:
    """One ring all-gather or reduce-scatter of a tensor of ``nbytes`` (full size) over n ranks."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bw + COLLECTIVE_LATENCY_S


# ------------------------------------------------------------------------------------------ per stage
def stage_costs(job: JobConfig, lay: Layout, stage: int) -> StageCosts:
    """F/B/W seconds per microbatch for one rank of ``stage``."""
    model, par, cl, pr = job.model, job.parallel, job.cluster, job.precision
    t, cp = lay.tp, lay.cp
    a = DTYPE_BYTES.get(pr.dtype, 2)
    tokens = job.train.micro_batch_size * model.seq_length  # per microbatch (whole sequence)
    share = tokens / (t * cp)  # per-rank share of per-token work (TP x CP; experts balanced over EP)
    eff = cl.gemm_efficiency
    bf16 = cl.peak_tflops_bf16 * 1e12 * eff
    gemm_peak = cl.peak_tflops_fp8 * 1e12 * cl.fp8_gemm_efficiency if pr.fp8 else bf16
    block = BLOCKWISE_FP8_TIME if pr.fp8 == "blockwise" else 1.0  # its GEMMs and casts, relative to tensorwise
    gemm_peak /= block
    hbm = cl.hbm_bandwidth_gbps * 1e9 * HBM_EFFICIENCY
    lf = layer_flops(model)
    pattern = lay.moe_pattern
    kinds = [pattern[i] for i in stage_layers(lay, stage)]
    last = stage == loss_rank(job.schedule.kind, lay.pp)
    zero_bubble = job.schedule.kind in Schedule.ZERO_BUBBLE and lay.pp > 1
    n_mtp = model.mtp_num_layers if last else 0
    kinds += [pattern[-1]] * n_mtp
    h = model.hidden_size
    parts = dict.fromkeys(("gemm", "attention", "elementwise", "fp8_cast", "tp_comm", "cp_comm", "ep_comm", "recompute",
                           "dp_comm", "host", "offload"), 0.0)
    fsdp_ag = fsdp_rs = 0.0
    if par.megatron_fsdp:
        dp_bw = _bandwidth(job, t * cp * lay.dp)
        full = fsdp_layer_params(job, lay)
        fsdp_ag = _ring((1 if pr.fp8_param else a) * full, lay.dp_cp, dp_bw)
        fsdp_rs = _ring((GRAD_BYTES_FP32 if pr.grad_reduce_in_fp32 else a) * full, lay.dp_cp, dp_bw)
    f = b = w = 0.0
    sp = sp_shards(lay)
    tp_bw = _bandwidth(job, t)
    cp_bw = _bandwidth(job, t * cp)
    act_full = a * h * tokens / cp  # one full-sequence-shard activation tensor (bytes)
    d = kv_channels(model)
    counts = {k: kinds.count(k) for k in set(kinds)}
    att_eff = _attention_efficiency(model.seq_length, cp)
    for is_moe, n in counts.items():
        core_fwd = lf.attn_core * share / 3
        g_attn = lf.attn_linear * share / 3 / gemm_peak  # one pass
        g_mlp = 0.0 if is_moe else lf.dense_mlp * share / 3 / gemm_peak
        g_shared = moe_fixed = 0.0
        if is_moe:
            routed, shared = _moe_split(model, lf.moe_mlp)
            g_shared = shared * share / 3 / gemm_peak
            g_mlp = routed * share / 3 * _capacity_scale(model) / (gemm_peak * _grouped_gemm_efficiency(job, lay, tokens))
            g_mlp += FMA * h * model.num_experts * tokens / (cp * sp) / bf16  # router GEMM (one pass)
            moe_fixed = MOE_LAYER_OVERHEAD_S
        g = g_attn + g_mlp + g_shared
        att = core_fwd / (bf16 * att_eff)
        if cp > 1:
            att += cp * CP_STEP_OVERHEAD_S
        elem = _elementwise_bytes(job, lay, is_moe) * tokens / cp / hbm + moe_fixed
        cast_f, cast_b = _fp8_cast_bytes(job, lay, is_moe)
        cast_f, cast_b = block * cast_f * tokens / cp / hbm, block * cast_b * tokens / cp / hbm
        # AG + RS (or an AR without SP) around attention and around a TP-sharded MLP, per pass. A routed-expert
        # MLP has none: its tokens move with the dispatcher (and ETP's own exchange); shared experts are TP MLPs.
        tp_mlp = not is_moe or bool(model.moe_shared_expert_intermediate_size)
        n_tp = 4 if tp_mlp else 2
        tp = tp_b = n_tp * _ring(act_full, t, tp_bw) if t > 1 else 0.0
        if tp and par.tp_comm_overlap and sp > 1:  # userbuffers pipeline the collective under its GEMM
            hide = g if not is_moe else g_attn + g_shared
            tp, tp_b = _overlapped_tp(tp, n_tp, hide), _overlapped_tp(tp, n_tp, hide, zero_bubble)
        cpc = 0.0
        if cp > 1 and not model.multi_latent_attention:
            kv_bytes = 2 * a * query_groups(model) * d * tokens / cp / t
            cpc = max(0.0, (cp - 1) * (kv_bytes / cp_bw + COLLECTIVE_LATENCY_S) - att)  # overlapped with attention
        epc = 0.0
        if is_moe and lay.ep * lay.etp > 1:  # expert parallelism, or expert TP alone (its gather and scatter)
            epc = 2 * _dispatch_time(job, lay, a * h * tokens / cp / sp)  # dispatch + combine, one pass
            if par.moe_a2a_overlap:
                epc = _overlapped_a2a(epc, g + att + elem,
                                      2 * g + ATTENTION_BWD_FACTOR * att + ELEMENTWISE_PASSES_BWD * elem,
                                      a2a_sm_share(model))
        fs_f = fs_b = 0.0
        if par.megatron_fsdp and lay.dp_cp > 1:  # per-layer parameter all-gather (fwd, bwd) + grad reduce-scatter
            fs_f = max(0.0, fsdp_ag - (g + att + elem))
            fs_b = max(0.0, fsdp_ag + fsdp_rs - (2 * g + ATTENTION_BWD_FACTOR * att + ELEMENTWISE_PASSES_BWD * elem))
        f += n * (g + att + elem + cast_f + tp + cpc + epc + fs_f)
        b += n * (g + ATTENTION_BWD_FACTOR * att + ELEMENTWISE_PASSES_BWD * elem + cast_b + tp_b + 2 * cpc + epc
                  + fs_b)
        parts["dp_comm"] += n * (fs_f + fs_b)
        w += n * g
        parts["gemm"] += n * 3 * g
        parts["attention"] += n * (1 + ATTENTION_BWD_FACTOR) * att
        parts["elementwise"] += n * (1 + ELEMENTWISE_PASSES_BWD) * elem
        parts["fp8_cast"] += n * (cast_f + cast_b)
        parts["tp_comm"] += n * (tp + tp_b)
        parts["cp_comm"] += n * 3 * cpc
        parts["ep_comm"] += n * 2 * epc
        rec = 0.0
        if job.train.recompute == Recompute.FULL:
            rec = recompute_fraction(job, lay, len(kinds) - n_mtp) * (g + att + elem + cast_f + tp + cpc + epc)
        elif job.train.recompute == Recompute.SELECTIVE:
            rec = _selective_recompute(job, recomputed_modules(job), is_moe, att, g_attn, g_mlp, g_shared,
                                       moe_fixed + (epc if is_moe else 0.0))
        b += n * rec
        parts["recompute"] += n * rec
        # host time: a pass whose GPU work is shorter than the host's issuing of its ops waits for the host
        host_f, host_b = host_seconds(job, is_moe)
        gpu_f = g + att + elem + cast_f + tp + cpc + epc + fs_f
        gpu_b = (g + ATTENTION_BWD_FACTOR * att + ELEMENTWISE_PASSES_BWD * elem + cast_b + tp_b + 2 * cpc + epc + fs_b
                 + rec)
        lump = overlap_host_seconds(job, model.num_experts // lay.ep) if is_moe else 0.0
        if lump:  # the combined schedule issues a forward and a backward (its W included) as one pair per layer,
            # and the dispatch's host sync keeps the host from running ahead of the pair: the pair waits for the host
            # by what issuing both passes takes beyond their GPU time, split over the two passes
            exposed_f = exposed_b = max(0.0, host_f + host_b + lump - (gpu_f + gpu_b + g)) / 2
        else:
            exposed_f, exposed_b = max(0.0, host_f - gpu_f), max(0.0, host_b - gpu_b)
        f += n * exposed_f
        b += n * exposed_b
        parts["host"] += n * (exposed_f + exposed_b)
        # activation offloading: a layer's offloaded tensors go to the host on a D2H stream and come back on an H2D
        # stream (bulk_reload_group prefetches one group ahead of its backward); both streams run beside compute
        # and PCIe is full duplex, so in the steady state each direction has a layer's forward and backward (one
        # of each per microbatch) to move that layer's bytes: only the excess is exposed, D2H on the forward
        # (the copy's memory is released when it lands), H2D on the backward (which waits for its reload)
        # The GPU's PCIe link also carries its network traffic (GPUDirect RDMA to a NIC behind the same switch): a
        # layer's inter-node expert dispatch and combine, both passes, each direction; only what the copies add to
        # that is charged here (the traffic's own time is ep_comm's)
        host_bytes = offloaded_bytes_per_token(job, lay, is_moe)[1] * tokens / cp
        if host_bytes:
            bw = cl.host_bandwidth_gbps * 1e9
            net = 4 * _dispatch_network_bytes(job, lay, a * h * tokens / cp / sp) if is_moe and lay.ep > 1 else 0.0
            window = gpu_f + gpu_b
            off_f = off_b = max(0.0, (host_bytes + net) / bw - window) - max(0.0, net / bw - window)
            f += n * off_f
            b += n * off_b
            parts["offload"] += n * (off_f + off_b)
    f, b = op_overhead(job, counts, f, b, parts)
    if last:  # output layer (+ MTP heads): GEMMs in BF16, plus the loss
        vp = lay.padded_vocab
        heads = 1 + n_mtp
        g = FMA * tokens / cp * h * vp / t * heads / bf16
        elem = 3 * 4 * tokens / cp * vp / t * heads / hbm  # fp32 softmax + gradient
        f += g + elem
        b += g + elem
        w += g
        parts["gemm"] += 3 * g
        parts["elementwise"] += 2 * elem
    return StageCosts(f, b, w, parts)


def _overlapped_tp(comm: float, n: int, hide: float, zero_bubble: bool = False) -> float:
    """Exposed part of one pass's ``n`` TP collectives (``comm`` seconds in all) under userbuffer overlap, which
    pipelines them under the pass's GEMMs (``hide`` seconds). Under a zero-bubble schedule the backward keeps half
    of them overlapped: the column-parallel input-gradient reduce-scatters run as TE's pipelined dgrad overlap
    (``tp_comm_overlap_rs_dgrad``) instead of the bulk overlap with the wgrad GEMM that W now runs later, and the
    row-parallel output-gradient all-gathers (proj, fc2) are NCCL, exposed: with ``ub_overlap_ag`` TE leaves the
    gathered gradient, the deferred wgrad GEMM's operand, in the shared userbuffer that the next layer's backward
    overwrites (models/deferred_wgrad.py ``zb_tp_overlap``; launcher/plan/NOTES.md)."""
    if not zero_bubble:
        return max(0.0, comm - hide) + n * COLLECTIVE_LATENCY_S
    half = comm / 2
    return half + max(0.0, half - hide) + n / 2 * COLLECTIVE_LATENCY_S


def _selective_recompute(job: JobConfig, mods: frozenset, moe: bool, att: float, g_attn: float, g_mlp: float,
                         g_shared: float, moe_extra: float) -> float:
    """Forward time recomputed in backward by train.recompute_modules, per layer: core attention, the MLA
    up-projections (their share of the attention GEMMs), the dense MLP, the whole MoE layer (its GEMMs, fixed
    costs and all-to-all) or its shared experts; the output-discarding ones (layernorm, moe_act) recompute
    element-wise work only, which is small and left out."""
    model = job.model
    rec = att if "core_attn" in mods else 0.0
    if "mla_up_proj" in mods and model.multi_latent_attention:
        n, h, qk = model.num_attention_heads, model.hidden_size, model.qk_head_dim + model.qk_pos_emb_head_dim
        up = (model.q_lora_rank or h) * n * qk + model.kv_lora_rank * n * (model.qk_head_dim + model.v_head_dim)
        down = h * (model.kv_lora_rank + model.qk_pos_emb_head_dim) + n * model.v_head_dim * h  # kv down, out proj
        rec += g_attn * up / (up + down)
    if "mlp" in mods and not moe:
        rec += g_mlp
    if "moe" in mods and moe:
        rec += g_mlp + g_shared + moe_extra
    elif "shared_experts" in mods and moe:
        rec += g_shared
    return rec


def _overlapped_a2a(comm: float, fwd: float, bwd: float, sm_share: float) -> float:
    """Exposed all-to-all per pass under parallel.moe_a2a_overlap. Megatron-Core's combined 1F1B schedule
    (``overlap_moe_expert_parallel_comm``: ``combined_1f1b_schedule_for_no_pipelining`` /
    ``..._for_interleaved_pipelining``) runs one microbatch's forward together with another's backward, layer by
    layer, each one's dispatch and combine on a communication stream under the other's computation (weight
    gradients included). For a forward/backward pair with all-to-all time C (``comm`` per pass, two passes) and
    compute T (``fwd`` + ``bwd``): while the all-to-all runs, computation has ``sm_share`` fewer SMs (the
    dispatcher's kernels, ``a2a_sm_share``), so the pair takes max(C, T + share x C); what it adds beyond T is
    split over the two passes."""
    c, t = 2 * comm, fwd + bwd
    return max(c - t, sm_share * c) / 2 + 2 * COLLECTIVE_LATENCY_S


def a2a_sm_share(model) -> float:
    """Share of SMs the token exchange's kernels hold while computation runs beside them: the flex
    dispatcher's (DeepEP / HybridEP) or NCCL's (alltoall; Megatron-Core overlaps no other dispatcher)."""
    return A2A_SM_SHARE if model.moe_token_dispatcher_type == "flex" else NCCL_A2A_SM_SHARE


def _attention_efficiency(seq: int, cp: int) -> float:
    """Flash-attention efficiency for the query blocks it works on: the whole sequence, or s / (2 CP)."""
    block = seq / (2 * cp) if cp > 1 else seq
    return block / (block + ATTENTION_HALF_SEQ)


def _moe_split(model, moe_mlp: float) -> tuple[float, float]:
    """An MoE MLP's FLOPs per token split into (routed experts, shared experts)."""
    routed = (model.moe_ffn_hidden_size or model.ffn_hidden_size) * model.moe_router_topk
    shared = model.moe_shared_expert_intermediate_size or 0
    return moe_mlp * routed / (routed + shared), moe_mlp * shared / (routed + shared)


def _grouped_gemm_efficiency(job: JobConfig, lay: Layout, tokens: int) -> float:
    """Relative efficiency of the expert GEMMs: n / (n + GROUPED_GEMM_HALF_TOKENS) for n tokens per local
    expert (balanced routing: every rank of the EP group receives its share of EP x local tokens x top-k, and
    expert tensor parallelism gathers ETP ranks' shares)."""
    model = job.model
    local_tokens = tokens / (lay.cp * sp_shards(lay))
    # per expert on one rank: what the EP group routed to it, gathered over its ETP group
    n = local_tokens * model.moe_router_topk * lay.ep * lay.etp / model.num_experts * _capacity_scale(model)
    return n / (n + GROUPED_GEMM_HALF_TOKENS)


def _dispatch_time(job: JobConfig, lay: Layout, token_bytes: float) -> float:
    """One token dispatch (or combine) of ``token_bytes`` of hidden states leaving each rank. alltoall and
    allgather send one copy per routed expert (top-k x token_bytes through the all-to-all); the flex dispatcher
    (DeepEP / HybridEP) sends a token over the network once per remote *node* that holds any of its experts and
    fans it out over NVLink there, so the network carries (expected remote nodes) x token_bytes. Token dropping
    with padding moves capacity-sized buffers (x the capacity factor)."""
    m = job.model
    k = m.moe_router_topk * _capacity_scale(m)
    etp = _etp_exchange(job, lay, token_bytes * k)
    if m.moe_token_dispatcher_type != "flex":
        return _a2a_time(job, lay, token_bytes * k) + etp
    on = token_bytes * k * (lay.ep - 1) / lay.ep  # every copy crosses NVLink once (direct, or forwarded in its node)
    return _links_time(job, on, _dispatch_network_bytes(job, lay, token_bytes)) + etp


def _dispatch_network_bytes(job: JobConfig, lay: Layout, token_bytes: float) -> float:
    """Bytes one dispatch (or combine) sends off the node from each rank (``_dispatch_time``'s network part, and
    what shares the PCIe link with activation offloading's copies): the off-node peers' share of the all-to-all's
    top-k copies, or the flex dispatcher's one copy per remote node."""
    m = job.model
    if m.moe_token_dispatcher_type != "flex":
        return _a2a_split(job, lay, token_bytes * m.moe_router_topk * _capacity_scale(m))[1]
    nodes = max(1, lay.ep // _ep_ranks_per_node(job, lay))
    return token_bytes * _capacity_scale(m) * remote_nodes_per_token(m, nodes)


def _etp_exchange(job: JobConfig, lay: Layout, routed_bytes: float) -> float:
    """Expert tensor parallelism's share of a dispatch (or combine): after the all-to-all every rank of an ETP
    group all-gathers the tokens its group's experts received (``routed_bytes`` per rank: its top-k copies), and
    the combine reduce-scatters their outputs (Megatron-Core's alltoall dispatcher,
    ``gather_from_sequence_parallel_region`` / ``reduce_scatter_to_sequence_parallel_region`` over the expert TP
    group). ETP ranks are consecutive (expert rank order tp-ep-dp-pp), so a group within a node uses NVLink."""
    if lay.etp <= 1:
        return 0.0
    return _ring(routed_bytes * lay.etp, lay.etp, _bandwidth(job, lay.etp))


def remote_nodes_per_token(model, nodes: int) -> float:
    """Expected number of other nodes holding at least one of a token's top-k experts, for an EP group over
    ``nodes`` nodes (experts are laid out contiguously: node j holds experts [j E/N, (j+1) E/N)), routing
    uniform over the allowed experts. Group-limited routing with a group count that nodes divide restricts a
    token to moe_router_group_topk groups (groups nest inside nodes): node-limited routing, as DeepSeek-V3's
    8 groups of 32 experts on 8 nodes. Each node is hit with probability 1 - C(G - G/N, g) / C(G, g) for g of G
    units chosen (units: groups, else experts)."""
    if nodes <= 1:
        return 0.0
    groups, gk = model.moe_router_num_groups, model.moe_router_group_topk
    if groups and gk and groups % nodes == 0:
        units, chosen = groups, gk
    else:
        units, chosen = model.num_experts, model.moe_router_topk
    per_node = units // nodes
    if per_node < 1:
        return float(nodes - 1)
    miss = math.comb(units - per_node, chosen) / math.comb(units, chosen) if chosen <= units - per_node else 0.0
    return (nodes - 1) * (1.0 - miss)


def _capacity_scale(model) -> float:
    """Tokens an expert processes relative to its balanced share: the capacity factor when inputs are padded
    to capacity; min(1, factor) when tokens beyond a capacity below the share are dropped; 1 when dropless
    (routing is taken as balanced: NVIDIA force-balances it in its benchmarks)."""
    cf = model.moe_expert_capacity_factor
    if cf is None:
        return 1.0
    return cf if model.moe_pad_expert_input_to_capacity else min(1.0, cf)


def _a2a_time(job: JobConfig, lay: Layout, nbytes: float) -> float:
    """One expert-parallel all-to-all of ``nbytes`` leaving each rank (before the (EP-1)/EP off-rank share):
    the on-node peers over NVLink and the off-node peers over the network run at the same time."""
    return _links_time(job, *_a2a_split(job, lay, nbytes))


def _a2a_split(job: JobConfig, lay: Layout, nbytes: float) -> tuple[float, float]:
    """(on-node, off-node) bytes of an all-to-all of ``nbytes`` leaving each rank: its EP peers on the node, and
    the others."""
    ep, on_node = lay.ep, _ep_ranks_per_node(job, lay)
    return nbytes * (on_node - 1) / ep, nbytes * (ep - on_node) / ep


def _ep_ranks_per_node(job: JobConfig, lay: Layout) -> int:
    """Ranks of one EP group on a node: consecutive ranks when ETP = 1 (Megatron's expert rank order), else
    spaced ETP apart."""
    return max(1, min(lay.ep, job.cluster.gpus_per_node // max(1, lay.etp)))


def _links_time(job: JobConfig, nvlink_bytes: float, network_bytes: float) -> float:
    """Bytes over NVLink and over the network at the same time, plus one collective's latency."""
    cl = job.cluster
    return max(nvlink_bytes / _link_bandwidth(cl, False), network_bytes / _link_bandwidth(cl, True)) \
        + COLLECTIVE_LATENCY_S


def _all_stage_costs(job: JobConfig, lay: Layout) -> list[StageCosts]:
    """stage_costs for every stage, computed once per distinct stage (middle stages are usually identical)."""
    p, pattern = lay.pp, lay.moe_pattern
    cache: dict = {}
    out = []
    for r in range(p):
        layers = stage_layers(lay, r)
        key = (r == 0, r == loss_rank(job.schedule.kind, p), sum(pattern[i] for i in layers), len(layers))
        if key not in cache:
            cache[key] = stage_costs(job, lay, r)
        out.append(cache[key])
    return out


def _layer_dims(job: JobConfig, lay: Layout, moe: bool) -> tuple:
    """(activation bytes, TP, SP shards, hidden, q width, kv width, MLP width incl. routed top-k + shared)."""
    model = job.model
    d = kv_channels(model)
    ffn = model.ffn_hidden_size
    if moe:
        ffn = (model.moe_ffn_hidden_size or ffn) * model.moe_router_topk + (model.moe_shared_expert_intermediate_size or 0)
    return (DTYPE_BYTES.get(job.precision.dtype, 2), lay.tp, sp_shards(lay), model.hidden_size,
            model.num_attention_heads * d, query_groups(model) * d, ffn)


def _elementwise_bytes(job: JobConfig, lay: Layout, moe: bool) -> float:
    """Forward element-wise HBM traffic per token per layer on one rank (bytes): two norms (read + write),
    two residual adds (2 reads + write), RoPE on Q and K, the gated activation (read 2f, write f)."""
    a, t, sp, h, q, kv, ffn = _layer_dims(job, lay, moe)
    m = 3 if job.model.activation == "swiglu" else 2
    out = a * (2 * 2 * h + 2 * 3 * h) / sp + a * (2 * (q + kv) * 2 + m * ffn) / t
    if moe:  # permute (read h, write k h) and unpermute (read k h, write h); router logits softmax/top-k
        k, e = job.model.moe_router_topk, job.model.num_experts
        out += (a * 2 * (1 + k) * h + 4 * 3 * e) / sp
    return out


def _fp8_cast_bytes(job: JobConfig, lay: Layout, moe: bool) -> tuple[float, float]:
    """FP8 quantisation traffic per token per layer on one rank (forward, backward), bytes: every GEMM input
    (forward) and every output gradient (backward) is read in BF16 and written as FP8 twice (row-wise and
    the transposed copy the other GEMM needs on Hopper). Zero without FP8."""
    if not job.precision.fp8:
        return 0.0, 0.0
    a, t, sp, h, q, kv, ffn = _layer_dims(job, lay, moe)
    m = 2 if job.model.activation == "swiglu" else 1
    per = a + 2
    fwd = per * (2 * h / sp + (q + ffn) / t)  # qkv and fc1 inputs (sequence-sharded), proj and fc2 inputs
    bwd = per * (2 * h / sp + (q + 2 * kv + m * ffn) / t)  # proj/fc2 output grads; qkv/fc1 output grads
    return fwd, bwd


# ------------------------------------------------------------------------------------------- the step
def _closed_form(kind: str, p: int, v: int, m: int, fs, bs, ws, t_comm: float):
    """Makespan from the closed forms (Narayanan et al. 2021; Qi et al. 2024): m x slowest stage + bubble of
    the mean stage; 1F1B (p-1)(F+B+W), interleaved (p-1)(F+B+W)/v, ZB-H1 (p-1)(F+B-W), plus 2(p-1) sends."""
    f, b, w = sum(fs) / p, sum(bs) / p, sum(ws) / p
    bubble = (p - 1) * (f + b + w)
    if kind == Schedule.INTERLEAVED:
        bubble /= v
    elif kind == Schedule.ZB_H1:  # over v chunks: each pass 1/v of a stage (schedules._zb_h1_interleaved)
        bubble = (p - 1) * max(f + b - w, 0.0) / v
    elif kind == Schedule.ZB_V:  # ZB-H1's over two half-size chunks (the simulated op list at T_F = T_B = T_W)
        bubble = (p - 1) * max(f + b - w, 0.0) / 2
    busy = m * max(x + y + z for x, y, z in zip(fs, bs, ws))
    makespan = busy + bubble + 2 * (p - 1) * t_comm
    total_busy = m * sum(x + y + z for x, y, z in zip(fs, bs, ws))
    return makespan, makespan - busy, 1.0 - total_busy / (p * makespan)


def _pipeline(job: JobConfig, lay: Layout, costs: list[StageCosts], t_comm: float, exact: bool = True):
    """Makespan, bubble and bubble fraction of the schedule; long runs are extrapolated from a short one
    (after the pipeline fills, each extra microbatch adds the slowest stage's F+B+W). ``exact=False`` uses
    the closed forms instead of the simulator (the search's first pass)."""
    p, v, m = lay.pp, lay.vpp, max(1, lay.microbatches)
    kind = job.schedule.kind if p > 1 else Schedule.ONE_F_ONE_B
    fs, bs, ws = [c.f for c in costs], [c.b for c in costs], [c.w for c in costs]
    if not exact or p == 1:
        return _closed_form(kind, p, v, m, fs, bs, ws, t_comm)
    group = lay.microbatch_group
    costs_v = job.schedule.zb_v_costs
    # zb_v: steady per p microbatches
    unit = group if kind == Schedule.INTERLEAVED or (kind == Schedule.ZB_H1 and v > 1) else p if kind == Schedule.ZB_V else 1
    cap = max(3 * p, 2 * unit)
    cap = -(-cap // unit) * unit
    if m <= cap + unit:
        res = simulate_kind(kind, p, m, fs, bs, ws, v=v, t_comm=t_comm, group=group, costs=costs_v)
        return res.makespan, res.bubble, res.bubble_fraction
    r1 = simulate_kind(kind, p, cap, fs, bs, ws, v=v, t_comm=t_comm, group=group, costs=costs_v)
    r2 = simulate_kind(kind, p, cap + unit, fs, bs, ws, v=v, t_comm=t_comm, group=group, costs=costs_v)
    # each extra microbatch adds at least the busiest stage's F+B+W: an order whose short runs end with idle it
    # sheds as m grows (ZB-V for per-stage costs) has a smaller difference, which must not extrapolate below
    # the work itself (a negative bubble)
    per_mb = max((r2.makespan - r1.makespan) / unit, max(f + b + w for f, b, w in zip(fs, bs, ws)))
    makespan = r2.makespan + (m - cap - unit) * per_mb
    busy = m * max(f + b + w for f, b, w in zip(fs, bs, ws))
    bubble = max(0.0, makespan - busy)
    total_busy = m * sum(f + b + w for f, b, w in zip(fs, bs, ws))
    return makespan, bubble, 1.0 - total_busy / (p * makespan)


def zb_v_costs_estimate(job: JobConfig, lay: Layout | None = None, decimals: int = 2,
                        per_stage: bool = False) -> list[float]:
    """The planner's relative chunk costs for this job's ZB-V order, largest = 1, rounded to ``decimals``: what
    schedule.zb_v_costs should be. The mean stage's [T_F, T_B, T_W]; with ``per_stage``, one triple per stage (6 x
    PP: rank r's costs for its stages r and 2p - 1 - r, split evenly between its chunks as the simulator splits
    them, so the order sees the V's rank 0 holding the embedding and the output layer + loss), or the one triple
    where every stage's rounds alike. The search sets it on its zb_v candidates with one decimal, so they share a
    few orders (each generated once); :func:`zb_v_costs_best` picks between the two forms."""
    lay = lay or derive(job)
    costs = _all_stage_costs(job, lay)
    least = 10.0 ** -decimals
    if not per_stage:
        mean = [sum(getattr(c, k) for c in costs) / len(costs) for k in "fbw"]
        return [max(least, round(x / max(mean), decimals)) for x in mean]
    top = max(max(c.f, c.b, c.w) for c in costs)
    rank = [tuple(max(least, round(getattr(c, k) / top, decimals)) for k in "fbw") for c in costs]
    if all(t == rank[0] for t in rank):
        return list(rank[0])
    p = len(rank)
    return [x for s in range(2 * p) for x in rank[min(s, 2 * p - 1 - s)]]


def zb_v_costs_best(job: JobConfig, lay: Layout | None = None, decimals: int = 2,
                    own: StepTime | None = None) -> tuple[list[float], StepTime]:
    """Of the mean triple (``decimals``) and the per-stage costs (one and two decimals), the schedule.zb_v_costs
    whose order the planner times shortest for this job, and that step time; ties keep the triple (the shorter
    override). The list scheduler is a heuristic and the planner's step adds p2p time and extrapolates long
    runs, so the per-stage form is tried, not assumed better (Llama3-70B at VPP 2: bubble 5.3% with the triple's
    order, 4.7% with per-stage costs at one decimal, 5.6% at two; Qwen3-30B-A3B on H200: 5.7%, 5.6%, 5.3%).
    ``own``: the step time of the job's own schedule.zb_v_costs, where the caller has it (not timed again)."""
    lay = lay or derive(job)
    options = [zb_v_costs_estimate(job, lay, decimals)]
    for d in (1, 2):
        c = zb_v_costs_estimate(job, lay, d, per_stage=True)
        if len(c) > 3 and c not in options:
            options.append(c)

    def timed_for(c: list[float]) -> StepTime:
        if own is not None and c == job.schedule.zb_v_costs:
            return own
        return step_time(dataclasses.replace(job, schedule=dataclasses.replace(job.schedule, zb_v_costs=c)), lay)

    timed = [(timed_for(c), c) for c in options]
    st, best = timed[0]
    for t, c in timed[1:]:
        if t.step_s < st.step_s * (1 - 1e-4):
            st, best = t, c
    return best, st


def step_time(job: JobConfig, lay: Layout | None = None, exact: bool = True) -> StepTime:
    """Predicted step time and breakdown for the job's layout (``lay``: derived if None; ``exact=False``:
    closed-form bubble)."""
    model, par, cl = job.model, job.parallel, job.cluster
    lay = lay or derive(job)
    p, t, cp = lay.pp, lay.tp, lay.cp
    a = DTYPE_BYTES.get(job.precision.dtype, 2)
    m = max(1, lay.microbatches)
    costs = _all_stage_costs(job, lay)
    sp = sp_shards(lay)
    tokens = job.train.micro_batch_size * model.seq_length
    t_comm = 0.0
    if p > 1:
        pp_bw = _bandwidth(job, lay.world)  # stages are the outermost dimension: across nodes when world > node
        t_comm = a * model.hidden_size * tokens / cp / sp / pp_bw + COLLECTIVE_LATENCY_S
    pipeline_s, bubble_s, bubble_frac = _pipeline(job, lay, costs, t_comm, exact)
    pipeline_s = max(pipeline_s, shared_units_s(job, lay, costs, m))  # ranks sharing cores wait for each other
    # Data parallel: reduce-scatter of gradients (or all-reduce) and all-gather of updated parameters.
    dp_cp, edp = grad_groups(lay)
    dp_bw = _bandwidth(job, t * cp * lay.dp)
    per_stage = [stage_params(job, r, lay) for r in range(p)]
    worst = max(range(p), key=lambda r: per_stage[r].total)
    rp = per_stage[worst]
    grad_bytes = GRAD_BYTES_FP32 if job.precision.grad_reduce_in_fp32 else a
    rs = _ring(grad_bytes * rp.dense, dp_cp, dp_bw) + _ring(grad_bytes * rp.expert, edp, dp_bw)
    dense_bytes, expert_bytes = param_bytes(job, rp)  # the storage gathered: FP8 layer GEMM weights 1 byte (fp8_param)
    ag = _ring(dense_bytes, dp_cp, dp_bw) + _ring(expert_bytes, edp, dp_bw)
    if not par.distributed_optimizer:
        rs, ag = 2 * rs, 0.0  # all-reduce = reduce-scatter + all-gather of gradients; no param gather
    if par.megatron_fsdp:
        rs = ag = 0.0  # per layer, inside the stage costs
    c = costs[worst]
    hide_rs = 0.0
    if par.overlap_grad_reduce:  # behind the last microbatch's backward; under zero bubble its W only (a
        # bucket's reduce starts after the last W of its weights, launcher/rank/zb_executor.py _grad_sync)
        hide_rs = c.w if job.schedule.kind in Schedule.ZERO_BUBBLE and p > 1 else c.b + c.w
    hide_ag = c.f if (par.overlap_param_gather and par.distributed_optimizer) else 0.0  # first forward
    dp_exposed = max(0.0, rs - hide_rs) + max(0.0, ag - hide_ag)
    # Optimizer: read/write fp32 master + 2 moments, read grads, write params, on this rank's shard.
    dense_shards, expert_shards = optimizer_shards(job, lay)
    shard = rp.dense / dense_shards + rp.expert / expert_shards
    optimizer_s = shard * (3 * 4 * 2 + grad_bytes + a) / (cl.hbm_bandwidth_gbps * 1e9 * HBM_EFFICIENCY)
    if job.train.optimizer_cpu_offload:
        optimizer_s = optimizer_s * (1 - job.train.optimizer_offload_fraction) + optimizer_offload_copy_s(job, shard)
    step = pipeline_s + dp_exposed + optimizer_s
    busiest = max(costs, key=lambda c: c.f + c.b + c.w)
    breakdown = {k: v * m for k, v in busiest.parts.items()}
    breakdown.update(pp_bubble=bubble_s, dp_comm=breakdown.get("dp_comm", 0.0) + dp_exposed, optimizer=optimizer_s)
    return StepTime(step, pipeline_s, bubble_s, bubble_frac, dp_exposed, optimizer_s, breakdown,
                    [(c.f, c.b, c.w) for c in costs])


def optimizer_offload_copy_s(job: JobConfig, shard: float) -> float:
    """train.optimizer_cpu_offload: the PCIe copies of the host's share of the optimizer each step. Megatron-Core's
    HybridDeviceOptimizer (optimizer/cpu_offloading/hybrid_optimizer.py) copies each offloaded main gradient to
    pinned host memory before the host Adam step (``_set_sub_optimizer_grads``) and the updated main parameter back
    after it (``param_copy_back_gpu_hook``), in the main-parameter dtype. No compute runs beside them (the step sits
    between the last backward and the next forward); with overlap_cpu_optimizer_d2h_h2d the two directions pipeline
    per parameter group, so the longer one counts. A lower bound: the host Adam step itself is not priced."""
    pr, tr = job.precision, job.train
    elements = shard * tr.optimizer_offload_fraction
    bw = job.cluster.host_bandwidth_gbps * 1e9
    return elements * main_param_bytes(pr) / bw * (1 if tr.overlap_cpu_optimizer_d2h_h2d else 2)


def throughput(job: JobConfig, st: StepTime, lay: Layout | None = None) -> dict:
    """tokens/s, TFLOP/s per GPU and MFU (model FLOPs / BF16 dense peak) for a predicted step time."""
    lay = lay or derive(job)
    world, tokens = lay.world, lay.tokens_per_step
    tflops = flops_per_step(job.model, tokens) / st.step_s / world / 1e12
    return {"tokens_per_s": tokens / st.step_s, "tokens_per_s_per_gpu": tokens / st.step_s / world,
            "tflops_per_gpu": tflops, "mfu": tflops / job.cluster.peak_tflops_bf16}
