"""Host time: how long the host takes to issue a layer's GPU ops, and what CUDA graphs (train.cuda_graph_impl)
leave of it. ``timing.stage_costs`` charges a layer pass the part of it its GPU work does not cover; under the MoE
all-to-all overlap with a host-synchronising dispatch it charges the layer pair (one microbatch's forward with
another's backward) the part of ``host_seconds`` + ``overlap_host_seconds`` its GPU work does not cover.
Constants and their sources: ``launcher/plan/NOTES.md`` (Time, host time). Pure Python: no torch, no megatron.
"""
from __future__ import annotations

from launcher.schema import JobConfig

HOST_OP_S = 8e-6
"""Host time to issue one GPU op in eager PyTorch (Python, the dispatcher, cudaLaunchKernel); not fitted (an
order of magnitude): no published row separates it from the GPU time of the same ops (launcher/plan/NOTES.md)."""
OVERLAP_HOST_PER_EXPERT_S = 0.87e-3
"""Host time per local expert per layer pair that Megatron-Core's combined 1F1B schedule
(parallel.moe_a2a_overlap) spends when the dispatch synchronises with the host (dropless routing, or a capacity
without padding): fitted on ONE published row, Megatron-Bridge 25.11's Qwen3-30B-A3B H100 run (v0.2.0 recipe: PP2 x
VP12 x EP8, 16 local experts, alltoall dispatcher, 5,275 tokens/s/GPU); held out: 26.02's DeepEP run of the same
layout (5,113). A lump for what the planner cannot itemise (NVIDIA drops the overlap "due to CPU overhead",
Megatron-Bridge PR #1760), ~100x a kernel launch: see launcher/plan/NOTES.md (host time) for why per local expert
and what it is not."""
HOST_OPS = {"attn": (40, 50), "mlp": (15, 21), "moe_router": (15, 18), "moe_preprocess": (10, 12),
            "moe_experts": (16, 23)}
"""Ops issued per layer part (forward, backward). Measured totals, split by reading the modules: Megatron-Core
0.19.2's local spec on CPU issues 55 / 71 non-view aten ops per dense layer (attn + mlp) and 96 / 124 per MoE layer
with 4 experts (attn + moe_*), counted with a TorchDispatchMode over the forward and the backward of 1- and
3-layer models (the difference over 2). Transformer Engine fuses some of them (fewer ops): an upper bound there."""
GRAPH_LAUNCH_OPS = 1
"""A graphed part costs the host one launch (cudaGraphLaunch) instead of its ops."""
LAYER_PARTS = {False: ("attn", "mlp"), True: ("attn", "moe_router", "moe_preprocess", "moe_experts")}
"""The ``HOST_OPS`` parts of a dense (False) and an MoE (True) layer."""


def host_parts(job: JobConfig, moe: bool) -> tuple[str, ...]:
    """The parts of one layer (``HOST_OPS`` keys) that train.cuda_graph_impl captures in a graph (all of the layer
    when train.cuda_graph_modules is empty; moe captures router, preprocess and experts)."""
    layer = LAYER_PARTS[moe]
    if job.train.cuda_graph_impl == "none":
        return ()
    mods = set(job.train.cuda_graph_modules)
    if not mods:
        return layer
    if "moe" in mods:
        mods |= {"moe_router", "moe_preprocess", "moe_experts"}
    if "moe_router" in mods and job.train.cuda_graph_impl == "local":  # Megatron-Core captures both together
        mods.add("moe_preprocess")
    return tuple(p for p in layer if p in mods)


def host_seconds(job: JobConfig, moe: bool) -> tuple[float, float]:
    """(forward, backward) host seconds to issue one layer's ops: ``HOST_OPS`` per part, a graphed part one launch
    per graph (attention one graph, the MLP/MoE part another; the whole layer one)."""
    layer = LAYER_PARTS[moe]
    graphed = host_parts(job, moe)
    eager = [p for p in layer if p not in graphed]
    graphs = (1 if set(graphed) == set(layer) and not job.train.cuda_graph_modules
              else int("attn" in graphed) + int(any(p != "attn" for p in graphed)))
    ops_f = sum(HOST_OPS[p][0] for p in eager) + GRAPH_LAUNCH_OPS * graphs
    ops_b = sum(HOST_OPS[p][1] for p in eager) + GRAPH_LAUNCH_OPS * graphs
    return ops_f * HOST_OP_S, ops_b * HOST_OP_S


def dispatch_syncs_host(job: JobConfig) -> bool:
    """Whether an MoE layer's token dispatch waits for the GPU on the host: Megatron-Core's alltoall dispatcher
    copies the token counts to the host and synchronises (``_maybe_dtoh_and_synchronize``) unless it drops and pads
    to a fixed capacity (``drop_and_pad``); DeepEP and HybridEP size their receive buffers from the counts likewise
    (HybridEP: "None means no up-bound, will cause a CPU sync")."""
    m = job.model
    return not (m.moe_expert_capacity_factor is not None and m.moe_pad_expert_input_to_capacity)


def overlap_host_seconds(job: JobConfig, local_experts: int) -> float:
    """Host seconds the combined 1F1B schedule adds per MoE layer pair (one microbatch's forward with another's
    backward) when parallel.moe_a2a_overlap is on and the dispatch synchronises with the host; 0 otherwise. The
    expert parts are never in a CUDA graph under dropless routing (validate: moe scope needs drop-and-pad), so graphs
    leave this term as it is."""
    if not (job.parallel.moe_a2a_overlap and dispatch_syncs_host(job)):
        return 0.0
    return OVERLAP_HOST_PER_EXPERT_S * local_experts
