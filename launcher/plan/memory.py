"""Memory per pipeline stage: weights, gradients, optimizer state, FP8 copies, activations, buffers, reserve.
One room (~650 lines): the terms of one sum, each beside its source, read top to bottom against Megatron-LM's
theoretical_memory_usage.py; split, a reader would go back and forth between the terms and their total.

The structure follows Megatron-LM ``megatron/training/theoretical_memory_usage.py`` (parameters split into
TP-sharded, replicated and expert-sharded; bytes per parameter 18, or 6 + 12/d with the distributed optimizer;
activations from Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
Table 2; in-flight microbatches of the pipeline schedule), extended to: GQA and SwiGLU shapes, MoE (experts
sharded over EP x ETP, their optimizer over expert-DP), MLA, MTP, context parallelism, FP8 weight copies and
FP8 GEMM inputs, every pipeline stage (not only the first), uneven first/last stages, and the last stage's
output layer and fp32 loss logits. Constants are documented in ``launcher/plan/NOTES.md``.

Everything is in bytes, for one rank of the given stage. Pure Python: no torch, no megatron.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from launcher.core import Layout, derive, moe_layer_pattern
from launcher.core.flops import kv_channels, query_groups
from launcher.core.pipeline.schedules import loss_rank
from launcher.plan.zb_states import (zb_h1_bound_states, zb_h1_front, zb_h1_reached_states, zb_h1_states, zb_peak_state,
                                     zb_v_bound_states, zb_v_front)
from launcher.schema import JobConfig, ModelConfig, Recompute, Schedule

GB = 1e9
"""Reports use GB = 10^9 bytes, as ClusterConfig.gpu_memory_gb does."""

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per element of parameters and activations for each training dtype."""
GRAD_BYTES_FP32 = 4
"""Megatron DDP's main-gradient buffer is fp32 when precision.grad_reduce_in_fp32 (its default with bf16);
otherwise it has the parameter dtype."""
ADAM_STATE_BYTES = 8
"""Adam exp_avg + exp_avg_sq, fp32."""
MASTER_BYTES = 4
"""fp32 master copy of bf16/fp16 parameters (none when training in fp32)."""
OPTIMIZER_STATE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
"""Bytes per element of the precision-aware optimizer's stored state (main weights, Adam moments)."""
FP8_WEIGHT_COPY_BYTES = 2
"""Transformer Engine keeps an FP8 copy of each GEMM weight and its transpose (Hopper) between microbatches."""
FP8_SCALE_BYTES = {"mxfp8": 1 / 32, "blockwise": 4 / 128}
"""Scale bytes per element of one quantised copy of an activation or gradient: MXFP8 one E8M0 byte per 32
elements; blockwise one fp32 per 1x128 block (TE ``Float8BlockScaling``: x and grad block_scaling_dim 1,
``Float8BlockQuantizer.get_scale_shape``); the per-tensor recipes (delayed, tensorwise) one scalar a tensor."""
NON_TN_FP8_GPUS = ("B200", "GB200")
"""GPUs whose FP8 GEMMs take non-TN layouts (TE ``utils.is_non_tn_fp8_gemm_supported``: compute capability 10.x):
there a per-tensor FP8 tensor serves both usages with one copy; before (Hopper) its columnwise usage is a
separate transpose (``Float8TensorStorage.update_usage``, ``csrc/quantizer.cpp``: ``with_transpose``)."""


def sp_shards(lay: Layout) -> int:
    """Sequence-parallel shards of the norm/dropout regions: TP when sequence parallelism is in effect, else 1."""
    return lay.tp if lay.sequence_parallel else 1


def stage_layers(lay: Layout, stage: int) -> list[int]:
    """Global decoder-layer indices held by ``stage``: its virtual chunks' layers, in chunk order."""
    return [i for chunk in lay.chunk_layers[stage] for i in chunk]


# ------------------------------------------------------------------------------------------- parameters
def _norm_params(model: ModelConfig) -> int:
    """Parameters per hidden unit of one norm: RMSNorm a weight, LayerNorm a weight and a bias."""
    return 1 if model.normalization == "RMSNorm" else 2


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one transformer layer, by how they are held: full sizes, before any sharding."""

    tp_sharded: float
    """Sharded over TP: QKV/output projections, dense MLP, shared experts."""
    replicated: float
    """Identical on every TP rank: norms, router, MLA down-projections, row-parallel biases."""
    expert: float
    """Routed experts: sharded over EP x ETP."""
    gemm: float
    """Of the above, GEMM weights (they get FP8 copies); TP/expert sharding applied by the caller."""
    gemm_expert: float
    """GEMM weights among the expert parameters."""


def _attention_params(model: ModelConfig) -> tuple[float, float, float]:
    """(tp_sharded, replicated, gemm_tp) parameters of one attention block including its input norm."""
    h, n = model.hidden_size, model.num_attention_heads
    norm = _norm_params(model)
    if model.multi_latent_attention:
        qk = model.qk_head_dim + model.qk_pos_emb_head_dim
        sharded = replicated = 0.0
        if model.q_lora_rank is None:
            sharded += h * n * qk
        else:
            replicated += h * model.q_lora_rank + norm * model.q_lora_rank  # duplicated down-proj + q norm
            sharded += model.q_lora_rank * n * qk
        replicated += h * (model.kv_lora_rank + model.qk_pos_emb_head_dim) + norm * model.kv_lora_rank
        sharded += model.kv_lora_rank * n * (model.qk_head_dim + model.v_head_dim)
        sharded += n * model.v_head_dim * h
        gemm_tp = sharded
        replicated += norm * h
        return sharded, replicated, gemm_tp
    d = kv_channels(model)
    q, kv = n * d, query_groups(model) * d
    sharded = h * (q + 2 * kv) + q * h
    gemm_tp = sharded
    replicated = norm * h  # input layernorm
    if model.add_bias_linear or model.add_qkv_bias:
        sharded += q + 2 * kv
    if model.add_bias_linear:
        replicated += h  # row-parallel output bias is full-size on every TP rank
    if model.qk_layernorm:
        replicated += 2 * norm * d
    return sharded, replicated, gemm_tp


def _mlp_params(model: ModelConfig, ffn: int) -> tuple[float, float]:
    """(weights, row-parallel bias) of one MLP of width ffn; weights include column-parallel biases."""
    h = model.hidden_size
    up = 2 * ffn if model.activation == "swiglu" else ffn
    weights = h * up + ffn * h
    if model.add_bias_linear:
        return weights + up, h
    return weights, 0.0


def layer_params(model: ModelConfig, moe: bool) -> LayerParams:
    """Parameters of one dense or MoE transformer layer."""
    h = model.hidden_size
    norm = _norm_params(model)
    sharded, replicated, gemm = _attention_params(model)
    replicated += norm * h  # pre-MLP layernorm
    expert = gemm_expert = 0.0
    if not moe:
        w, bias = _mlp_params(model, model.ffn_hidden_size)
        sharded += w
        replicated += bias
        gemm += w
    else:
        e_ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
        w, bias = _mlp_params(model, e_ffn)
        expert = (w + bias) * model.num_experts
        gemm_expert = w * model.num_experts
        replicated += h * model.num_experts  # router
        if model.moe_shared_expert_intermediate_size:
            w, bias = _mlp_params(model, model.moe_shared_expert_intermediate_size)
            sharded += w
            replicated += bias
            gemm += w
    return LayerParams(sharded, replicated, expert, gemm, gemm_expert)


@dataclass
class RankParams:
    """Parameters held by one rank (after TP/EP sharding), split by which group shards their optimizer."""

    dense: float = 0.0
    """Non-expert parameters (optimizer sharded over DP x CP)."""
    expert: float = 0.0
    """Routed-expert parameters (optimizer sharded over expert-DP)."""
    gemm: float = 0.0
    """GEMM weights among them (dense and expert), which get FP8 copies."""
    expert_gemm: float = 0.0
    """Of ``gemm``: the routed experts' GEMM weights (in ``expert``)."""
    embedding: float = 0.0
    """Of ``dense``: input embedding, output layer and position embedding on this rank."""

    @property
    def total(self) -> float:
        return self.dense + self.expert

    def as_dict(self) -> dict[str, float]:
        return {"dense": self.dense, "expert": self.expert, "total": self.total, "embedding": self.embedding}


def model_params(model: ModelConfig, tp: int = 1, padded_vocab: int | None = None) -> RankParams:
    """Parameters of the whole model (PP = EP = 1), for reporting; experts counted in full."""
    vocab = padded_vocab or model.vocab_size
    out = RankParams()
    pattern = moe_layer_pattern(model)
    for is_moe in pattern + [pattern[-1]] * (model.mtp_num_layers or 0):
        lp = layer_params(model, is_moe)
        out.dense += lp.tp_sharded / tp + lp.replicated
        out.expert += lp.expert
    h = model.hidden_size
    mtp = model.mtp_num_layers or 0
    out.dense += mtp * (2 * h * h / tp + 3 * _norm_params(model) * h)  # MTP eh_proj, enorm/hnorm/final norm
    emb = vocab * h / tp
    out.embedding = emb * (1 if model.tie_embeddings else 2)
    if model.position_embedding == "learned_absolute":
        out.embedding += (model.max_position_embeddings or model.seq_length) * h
    out.dense += out.embedding + _norm_params(model) * h  # + final layernorm
    return out


# ------------------------------------------------------------------------------------------ per stage
def stage_params(job: JobConfig, stage: int, lay: Layout | None = None) -> RankParams:
    """Parameters held by one rank of pipeline stage ``stage`` (``lay``: the job's layout, derived if None)."""
    model = job.model
    lay = lay or derive(job)
    tp, p, etp, ep = lay.tp, lay.pp, lay.etp, lay.ep
    pattern = lay.moe_pattern
    layers = stage_layers(lay, stage)
    n_moe = sum(1 for i in layers if pattern[i])
    counts = {True: n_moe, False: len(layers) - n_moe}
    last = stage == loss_rank(job.schedule.kind, p)
    if last and model.mtp_num_layers:
        counts[pattern[-1]] += model.mtp_num_layers
    out = RankParams()
    for is_moe, n in counts.items():
        if not n:
            continue
        lp = layer_params(model, is_moe)
        out.dense += n * (lp.tp_sharded / tp + lp.replicated)
        out.expert += n * lp.expert / (ep * etp)
        out.gemm += n * (lp.gemm / tp + lp.gemm_expert / (ep * etp))
        out.expert_gemm += n * lp.gemm_expert / (ep * etp)
    h = model.hidden_size
    norm = _norm_params(model)
    emb = lay.padded_vocab * h / tp
    embedding = 0.0
    if stage == 0:
        embedding += emb
        if model.position_embedding == "learned_absolute":
            embedding += (model.max_position_embeddings or model.seq_length) * h
    if last:
        out.dense += norm * h  # final layernorm
        if not (model.tie_embeddings and p == 1):
            embedding += emb  # output layer (a copy of the embedding when tied and PP > 1)
        if model.mtp_num_layers:
            out.dense += model.mtp_num_layers * (2 * h * h / tp + 3 * norm * h)  # eh_proj, enorm/hnorm/final
            out.gemm += model.mtp_num_layers * 2 * h * h / tp
            if p > 1 and not model.tie_embeddings:
                embedding += emb  # MTP needs the input embedding on the last stage too
    out.embedding = embedding
    out.dense += embedding
    return out


# ------------------------------------------------------------------------------------------ activations
def layer_activation_bytes_per_token(job: JobConfig, lay: Layout, moe: bool, *, full: bool = False) -> float:
    """Activation bytes one layer keeps per token of a microbatch on one rank, before CP (divide by CP).

    ``full`` ignores recomputation (the working set while a layer's forward is recomputed)."""
    model, rec = job.model, job.train.recompute
    mods = recomputed_modules(job)
    te = lay.transformer_engine
    t = lay.tp
    sp = sp_shards(lay)
    a = DTYPE_BYTES.get(job.precision.dtype, 2)
    g = 1 if job.precision.fp8 else a  # bytes of a saved GEMM input (TE saves FP8 casts under FP8)
    h, n, s = model.hidden_size, model.num_attention_heads, model.seq_length // lay.cp
    if rec == "full" and not full:
        return a * h / sp  # only the layer input is checkpointed
    drop = (h if model.hidden_dropout > 0 else 0) * 2  # two residual dropout masks (1 byte each)
    # Regions replicated across TP unless SP shards them: two norm inputs, two GEMM inputs, dropout masks
    # (recompute_modules 'layernorm' discards the norm outputs, i.e. the GEMM inputs, and recomputes them).
    sp_region = a * h + a * h + drop + (0 if "layernorm" in mods else 2 * g * h)
    if model.multi_latent_attention:
        qk = model.qk_head_dim + model.qk_pos_emb_head_dim
        latent = a * 2 * ((model.q_lora_rank or 0) + model.kv_lora_rank + model.qk_pos_emb_head_dim)
        # Q, K, V after the up-projections (discarded by 'mla_up_proj'), the attention output (+ FP8 copy)
        qkv = 0 if "mla_up_proj" in mods else a * (2 * n * qk + n * model.v_head_dim)
        attn_tp = qkv + a * n * model.v_head_dim + (g if g != a else 0) * n * model.v_head_dim
        sp_region += latent * sp  # duplicated down-projections work on the gathered sequence
    else:
        d = kv_channels(model)
        q, kv = n * d, query_groups(model) * d
        attn_tp = a * (q + 2 * kv) + a * q + (q if g != a else 0)  # Q, K, V; attention output (+ FP8 copy)
    core = 0.0
    flash = te  # TE's fused/flash attention never materialises the s x s scores
    if not flash and "core_attn" not in mods:
        core = n * s * (a + (1 + a if model.attention_dropout > 0 else 0))  # softmax out (+ mask, dropout out)
    m = 2 if model.activation == "swiglu" else 1
    if moe:
        e_ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
        etp = lay.etp
        k = model.moe_router_topk
        # What Megatron-Core's alltoall dispatcher + grouped MLP keep per routed token: the permuted expert
        # input (gathered over ETP; FP8 under FP8), fc1 output (the probs are applied inside the weighted
        # SwiGLU, so unpermute keeps no expert output) and the fc2 input, plus the fp32 routing probs. The
        # router's input is the bf16 pre-MLP norm output (in place of a dense FC1's GEMM input).
        sp_region += (a - g) * h if "layernorm" not in mods else 0
        act = 0 if "moe_act" in mods else g * e_ffn  # 'moe_act' discards the activation output (fc2 input)
        mlp_sp = k * g * h * etp + k * (a * m * e_ffn + act) + 4 * k
        if "moe" in mods:  # the whole MoE layer is recomputed from its input
            mlp_sp = 0.0
        shared = model.moe_shared_expert_intermediate_size or 0
        mlp_tp = 0.0 if "shared_experts" in mods or "moe" in mods else a * m * shared + g * shared
        per = sp_region / sp + (attn_tp + core) / t + mlp_sp / sp + mlp_tp / t
    else:
        f = model.ffn_hidden_size
        mlp_tp = 0.0 if "mlp" in mods else a * m * f + g * f
        per = sp_region / sp + (attn_tp + core + mlp_tp) / t
    return per


@dataclass(frozen=True)
class OffloadedTensor:
    """One tensor a module saves for backward that fine-grained activation offloading copies to the host."""

    module: str
    device_bytes: float
    """Bytes per token (of the microbatch, before CP) it would hold on the GPU."""
    host_bytes: float
    """Bytes per token it holds in pinned host memory instead (TE saves expert_fc1's bf16 input, not its FP8 cast)."""
    elements: float
    """Elements per token: Megatron-Core offloads only tensors of at least min_offloaded_tensor_size elements."""


def offloaded_tensors(job: JobConfig, lay: Layout, moe: bool) -> list[OffloadedTensor]:
    """train.activation_offload_modules: the saved tensors of one layer that go to the host, per token of a
    microbatch on one rank (the terms of ``layer_activation_bytes_per_token`` each module's offload context wraps:
    Megatron-Core 0.19.2 transformer_layer.py / attention.py / moe/experts.py ``off_interface`` around the module,
    ``ChunkOffloadHandler.tensor_need_offloading_checker``), before activation_offload_fraction. Modules whose
    context wraps nothing on this layer (validation refuses them where they never do) add nothing: attn_norm on
    the TE spec without MLA (the norm is fused into linear_qkv, input_layernorm is IdentityOp), mlp_norm on a dense
    TE layer (fused into linear_fc1), core_attn when it is recomputed (attention.py runs the checkpointed
    attention outside the context), the MoE modules on a dense layer."""
    mods = set(job.train.activation_offload_modules)
    if not mods or job.train.recompute == Recompute.FULL:  # a fully recomputed layer keeps only its input
        return []
    model, rec = job.model, recomputed_modules(job)
    t, sp = lay.tp, sp_shards(lay)
    a = DTYPE_BYTES.get(job.precision.dtype, 2)
    g = 1 if job.precision.fp8 else a
    h, n = model.hidden_size, model.num_attention_heads
    out: list[OffloadedTensor] = []

    def add(module: str, elements: float, size: float, host: float | None = None) -> None:
        if module in mods and elements > 0:
            out.append(OffloadedTensor(module, elements * size, elements * (size if host is None else host), elements))
    mla = model.multi_latent_attention
    if mla:
        add("attn_norm", h / sp, a)  # the real input_layernorm of the MLA spec: its input
        lat = 2 * ((model.q_lora_rank or 0) + model.kv_lora_rank + model.qk_pos_emb_head_dim)
        add("qkv_linear", h / sp, g)  # the down-projections' input
        add("qkv_linear", lat, a)  # the up-projections' inputs (latents, gathered sequence)
        qk = model.qk_head_dim + model.qk_pos_emb_head_dim
        q_in, kv_in, o = n * qk / t, n * (qk + model.v_head_dim) / t, n * model.v_head_dim / t
        qkv = 0 if "mla_up_proj" in rec else 1
    else:
        add("qkv_linear", h / sp, a)  # TE's LayerNormLinear saves the norm input ...
        if "layernorm" not in rec:
            add("qkv_linear", h / sp, g)  # ... and the normed GEMM input (unless recomputed)
        d = kv_channels(model)
        q_in, kv_in, o = n * d / t, 2 * query_groups(model) * d / t, n * d / t
        qkv = 1
    if "core_attn" not in rec:
        add("core_attn", qkv * (q_in + kv_in), a)  # Q, K, V saved by the attention kernel
        # its output O: also linear_proj's saved input unless FP8 casts it (then proj keeps the cast), so it leaves
        # the GPU only when nothing else holds it (Megatron-Core: "attn_proj cannot be set ... without core_attn")
        if g != a or "attn_proj" in mods:
            add("core_attn", o, a)
    if g != a:
        add("attn_proj", o, g)  # linear_proj's FP8 cast of its input
    if moe:
        e_ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
        k, m = model.moe_router_topk, 2 if model.activation == "swiglu" else 1
        add("mlp_norm", h / sp, a)  # the MoE spec's real pre_mlp_layernorm: its input
        if "moe" not in rec:
            # experts.py: with expert_fc1 offloaded TE saves fc1's original (bf16) input instead of its FP8 cast
            add("expert_fc1", k * h * lay.etp / sp, g, host=a if job.precision.fp8 != "mxfp8" else g)
            add("moe_act", k * m * e_ffn / sp, a)  # the fc1 output the activation (or its checkpoint) keeps
    return out


def offloaded_bytes_per_token(job: JobConfig, lay: Layout, moe: bool) -> tuple[float, float]:
    """(GPU bytes freed, host bytes held) per token of a microbatch for one layer: the tensors of
    ``offloaded_tensors`` at or above min_offloaded_tensor_size elements in one microbatch, times
    activation_offload_fraction (Megatron-Core keeps that share of each chunk's offload groups, the later ones on
    the GPU: ``PipelineOffloadManager.post_warmup_callback``)."""
    tensors = offloaded_tensors(job, lay, moe)
    if not tensors:
        return 0.0, 0.0
    tokens = job.train.micro_batch_size * job.model.seq_length / lay.cp
    big = [x for x in tensors if x.elements * tokens >= job.train.min_offloaded_tensor_size]
    share = job.train.activation_offload_fraction
    return share * sum(x.device_bytes for x in big), share * sum(x.host_bytes for x in big)


def recomputed_modules(job: JobConfig) -> frozenset:
    """Submodules recomputed under train.recompute=selective (Megatron's default: core attention)."""
    if job.train.recompute != Recompute.SELECTIVE:
        return frozenset()
    return frozenset(job.train.recompute_modules or ("core_attn",))


def logit_bytes(job: JobConfig, mtp: int) -> float:
    """Bytes per token per local vocabulary entry that the loss holds at its peak on the last stage: the saved
    softmax of every head (main + MTP) and one logits transient in the activation dtype. Megatron's unfused
    vocab-parallel cross entropy keeps an fp32 softmax (4 bytes); the fused one
    (model.cross_entropy_loss_fusion) keeps it in the logits dtype."""
    a = DTYPE_BYTES.get(job.precision.dtype, 2)
    soft = a if job.model.cross_entropy_loss_fusion else 4
    return soft * (1 + mtp) + a


def recompute_fraction(job: JobConfig, lay: Layout, layers: int) -> float:
    """Share of a stage's ``layers`` under full recompute: all, or recompute_num_layers per model chunk
    (Megatron's block method recomputes the first n layers of each chunk)."""
    if job.train.recompute != Recompute.FULL or layers == 0:
        return 0.0
    n = job.train.recompute_num_layers
    if n is None:
        return 1.0
    return min(1.0, n * lay.vpp / layers)


def in_flight_microbatches(job: JobConfig, lay: Layout, stage: int) -> float:
    """Microbatches whose activations a stage holds at its peak, in units of the whole stage's layers.

    1F1B: stage r warms up with p - r - 1 forwards and runs one more before its first backward, so it holds
    p - r (the first stage p). ZB-H1 has the same F/B order, but what it holds besides is read from its op list
    (``zb_peak_state``; ``stage_memory`` uses that instead of this count). Interleaved: stage r
    holds 2(p - r - 1) + (v - 1) g + 1 model-chunk microbatches (Megatron's warm-up count + 1, g the
    microbatch group size, default p), each 1/v of the stage: for r = 0 and g = p this is Megatron's
    p (1 + (p - 1)/(p v)); one more with parallel.moe_a2a_overlap (schedules.py: the combined 1F1B schedule
    runs an extra warm-up forward). Capped by the microbatches that exist.
    """
    p, v = lay.pp, lay.vpp
    m = max(1, lay.microbatches)
    if p == 1:
        return 1.0
    if job.schedule.kind == Schedule.INTERLEAVED and v > 1:
        group = lay.microbatch_group
        chunks = 2 * (p - stage - 1) + (v - 1) * group + 1
        if job.parallel.moe_a2a_overlap:  # the combined 1F1B schedule warms up one chunk-microbatch more
            chunks += 1
        return min(chunks, m * v) / v
    return float(min(p - stage, m))


# ------------------------------------------------------------------------- ZB-H1: deferred weight gradients
# (the op lists' states: launcher/plan/zb_states.py; here their bytes)
def _deferred_gemms(job: JobConfig, lay: Layout, moe: bool) -> list[tuple[float, float, bool]]:
    """(input width, output-gradient width, input gathered) per token of every deferred linear of one layer on
    one rank.

    What a W keeps is the GEMM ``grad_output^T @ input`` (Megatron's ``LinearWithGradAccumulationAndAsync
    Communication.backward`` / TE's ``wgrad_store.put([inputmat_total, grad_output], ...)``): a column-parallel
    layer's input is full-width h on every TP rank (replicated, or under SP all-gathered into a fresh buffer over
    the whole sequence) and its output gradient 1/TP; a row-parallel layer's input is 1/TP and its output
    gradient full h over the whole sequence (the backward of SP's reduce-scatter is an all-gather). Widths are
    per token of the whole micro-batch sequence, before CP (the caller multiplies by the rank's tokens).
    "Input gathered": TE all-gathers the input in the backward (a column-parallel TE layer under SP,
    ``backward_input_needs_gather``), which decides what an FP8 input costs (``wgrad_operand_bytes``); MLA's
    down-projections are TE ``parallel_mode='duplicated'`` and routed experts' GroupedLinear gathers nothing."""
    model, t = job.model, lay.tp
    h, n = model.hidden_size, model.num_attention_heads
    ag = sp_shards(lay) > 1  # a column-parallel layer's input is all-gathered in its backward
    if model.multi_latent_attention:
        qk, v = model.qk_head_dim + model.qk_pos_emb_head_dim, model.v_head_dim
        gemms = [(h, model.kv_lora_rank + model.qk_pos_emb_head_dim, False),  # duplicated KV down-projection
                 (model.kv_lora_rank, n * (model.qk_head_dim + v) / t, ag), (n * v / t, h, False)]
        if model.q_lora_rank is None:
            gemms.append((h, n * qk / t, ag))
        else:
            gemms += [(h, model.q_lora_rank, False), (model.q_lora_rank, n * qk / t, ag)]
    else:
        d = kv_channels(model)
        q, kv = n * d, query_groups(model) * d
        gemms = [(h, (q + 2 * kv) / t, ag), (q / t, h, False)]  # linear_qkv (column), linear_proj (row)
    up = 2 if model.activation == "swiglu" else 1

    def mlp(f: float, shards: int, per_token: float = 1.0, gathered: bool = ag) -> list[tuple[float, float, bool]]:
        return [(per_token * h, per_token * up * f / shards, gathered), (per_token * f / shards, per_token * h, False)]
    if not moe:
        return gemms + mlp(model.ffn_hidden_size, t)
    if model.moe_shared_expert_intermediate_size:
        gemms += mlp(model.moe_shared_expert_intermediate_size, t)
    # Routed experts: k routed copies per local token (tokens/SP after dispatch on average), gathered over ETP,
    # as layer_activation_bytes_per_token counts them.
    routed = model.moe_router_topk * lay.etp / sp_shards(lay)
    return gemms + mlp(model.moe_ffn_hidden_size or model.ffn_hidden_size, lay.etp, routed, gathered=False)


def wgrad_operand_bytes(job: JobConfig, gathered_input: bool) -> tuple[float, float]:
    """Bytes per element of the (input, output gradient) a deferred W keeps until ``backward_dw``.

    Without FP8 both are in the activation dtype. Under FP8 they are the quantised tensors TE's backward hands
    to ``wgrad_store.put`` (``module/linear.py`` ``_Linear.backward`` / ``_linear_backward``, alike in
    ``layernorm_linear.py``, ``layernorm_mlp.py`` and ``grouped_linear.py``; TE 2.7 to 2.20.0.dev0):
    - output gradient: quantised once for both GEMMs (``grad_output_quantizer.set_usage(rowwise=True,
      columnwise=True)``: rowwise for dgrad, columnwise for wgrad; grouped_linear's quantizers keep the default
      of both), and ``update_usage(columnwise_usage=True)`` before the store drops neither: two copies (one on
      Blackwell for the per-tensor recipes, whose single copy serves both layouts);
    - input: the forward's cast keeps only its columnwise copy for backward (``update_usage(rowwise_usage=False,
      columnwise_usage=True)``): one copy; but a per-tensor-FP8 input that TE all-gathers in backward (column-
      parallel under SP: ``supports_only_rowwise_all_gather``) is gathered rowwise and given its transpose by
      ``update_usage(columnwise_usage=True)`` (distributed.py ``_all_gather_fp8``), both kept on Hopper; MXFP8
      and blockwise gather the columnwise copy alone (``set_quantizer_usage_for_wgrad_all_gather``);
    - each copy is 1 byte an element plus its scales (``FP8_SCALE_BYTES``).
    Zero bubble here turns off ``ub_overlap_ag`` on row-parallel layers (``models.deferred_wgrad``), the one
    setting under which TE quantises the output gradient rowwise only."""
    pr = job.precision
    if not pr.fp8:
        a = DTYPE_BYTES.get(pr.dtype, 2)
        return a, a
    copy = 1 + FP8_SCALE_BYTES.get(pr.fp8, 0.0)
    if pr.fp8 not in FP8_SCALE_BYTES and job.cluster.gpu in NON_TN_FP8_GPUS:  # per-tensor, one copy serves both
        return copy, copy
    per_tensor_gathered = gathered_input and pr.fp8 not in FP8_SCALE_BYTES
    return (2 if per_tensor_gathered else 1) * copy, 2 * copy


def layer_wgrad_bytes_per_token(job: JobConfig, lay: Layout, moe: bool) -> float:
    """Bytes one pending W of one layer holds per token of the micro-batch (before CP): every deferred linear's
    input and output gradient at ``wgrad_operand_bytes`` each."""
    total = 0.0
    for i, o, gathered in _deferred_gemms(job, lay, moe):
        bi, bo = wgrad_operand_bytes(job, gathered)
        total += i * bi + o * bo
    return total


def output_wgrad_bytes_per_token(job: JobConfig, lay: Layout) -> float:
    """Bytes the last stage's pending output-layer W holds per token: its input (h, full width) and the logits
    gradient (padded vocabulary / TP), in the activation dtype (GPTModel's output layer is Megatron's own
    ColumnParallelLinear on every backend, deferred by ``models.deferred_wgrad.defer_output_layer``)."""
    return DTYPE_BYTES.get(job.precision.dtype, 2) * (job.model.hidden_size + lay.padded_vocab / lay.tp)


def stage_wgrad_bytes(job: JobConfig, lay: Layout, stage: int) -> float:
    """Bytes one microbatch's pending W holds on one rank of ``stage``: every deferred linear of its layers,
    and on the last stage the output layer's input and logits gradient."""
    layers = stage_layers(lay, stage)
    n_moe = sum(1 for i in layers if lay.moe_pattern[i])
    per_token = sum(n * layer_wgrad_bytes_per_token(job, lay, moe)
                    for moe, n in ((True, n_moe), (False, len(layers) - n_moe)) if n)
    if stage == loss_rank(job.schedule.kind, lay.pp):
        per_token += output_wgrad_bytes_per_token(job, lay)
    return per_token * job.train.micro_batch_size * job.model.seq_length / lay.cp


def zb_h1_held_wgrad_bytes(job: JobConfig, lay: Layout, stage: int) -> float:
    """The most bytes the W store of ``stage`` holds at once in a step: the most microbatches its op list
    leaves pending (``zb_h1_states``) times one microbatch's pending W."""
    states = zb_h1_states(lay.pp, max(1, lay.microbatches))[stage]
    return max(pending for _, pending in states) * stage_wgrad_bytes(job, lay, stage)


# --------------------------------------------------------------------------------------------- per stage
@dataclass
class StageMemory:
    """Predicted peak memory of one rank of a pipeline stage, in bytes."""

    stage: int
    """Pipeline stage index (0 = first)."""
    layers: int
    """Decoder layers on the stage (MTP layers excluded)."""
    params: float
    """Parameters on one rank (dense + expert)."""
    in_flight: float
    """Microbatches of activations held at the peak (in whole-stage units)."""
    parts: dict = field(default_factory=dict)
    """Bytes by contributor: weights, grads, optimizer, fp8_weights, activations, output_logits,
    pending_wgrad (ZB-H1 only), comm_buffers, workspace, reserve."""
    pending_w: int = 0
    """ZB-H1: microbatches whose weight gradient is pending at the peak (their GEMM inputs and output
    gradients are ``parts['pending_wgrad']``)."""
    host: dict = field(default_factory=dict)
    """Host memory the rank's offloads hold at the peak, by lever (not GPU memory, not in ``total``): activations
    (train.activation_offload_modules, pinned) and optimizer (train.optimizer_cpu_offload's state and copies)."""

    @property
    def host_bytes(self) -> float:
        return float(sum(self.host.values()))

    @property
    def total(self) -> float:
        return float(sum(self.parts.values()))

    def largest(self, k: int = 3) -> list[tuple[str, float]]:
        """The k largest contributors, (name, bytes)."""
        return sorted(self.parts.items(), key=lambda kv: -kv[1])[:k]

    def to_dict(self) -> dict:
        return {"stage": self.stage, "layers": self.layers, "params": self.params, "in_flight": self.in_flight,
                "pending_w": self.pending_w, "host_gb": self.host_bytes / GB,
                "host_parts_gb": {k: v / GB for k, v in self.host.items()}, "total_gb": self.total / GB, "parts_gb": {k: v / GB for k, v in self.parts.items()}}


def grad_groups(lay: Layout) -> tuple[int, int]:
    """Ranks over which (dense, expert) gradients are reduced: DP x CP and expert DP (at least 1, so a size
    the layout leaves undefined never divides by zero)."""
    return max(1, lay.dp_cp), max(1, lay.expert_dp)


def optimizer_shards(job: JobConfig, lay: Layout) -> tuple[int, int]:
    """Ranks sharing the (dense, expert) optimizer state: the gradient groups with the distributed optimizer."""
    return grad_groups(lay) if job.parallel.distributed_optimizer else (1, 1)


def param_bytes(job: JobConfig, rp: RankParams) -> tuple[float, float]:
    """Bytes of one rank's (dense, expert) parameters as the model holds them, which is also what the distributed
    optimizer's parameter all-gather moves: the activation dtype's, except the layer GEMM weights under
    ``precision.fp8_param`` (FP8 primary weights, 1 byte; ``rp.gemm`` leaves out the embedding, output layer,
    norms and router, which stay in their dtype).

    Megatron-Core 0.19.2: the transformer block builds each layer under TE's ``fp8_model_init``
    (``transformer/transformer_block.py`` ``build_layer``: ``get_fp8_context(layer_config, global_layer_number - 1,
    is_init=True)``; ``fp8_utils.py``: ``need_fp8_context = config.fp8 if not is_init else config.fp8_param``), so
    only its TE linear / grouped-linear weights are Float8Tensors. The DDP buffers are grouped by storage dtype
    (``distributed/param_and_grad_buffer.py`` ``group_params_for_buffers``: "param_dtype: storage dtype
    (torch.uint8 for FP8/NVFP4 parameters, else param.dtype)"; ``if _param_uses_quantized_storage(param):
    param_dtype = torch.uint8``, ``_param_uses_quantized_storage`` = ``is_float8tensor(param) or ...``), each
    buffer's ``param_data = torch.zeros(numel, dtype=self.param_dtype, ...)``, and ``start_param_sync`` gathers
    exactly that storage (``dist_all_gather_func(bucket.param_data, local_data_view, group=...)``): 1 byte per
    FP8 parameter, the dtype's bytes for the rest."""
    a = DTYPE_BYTES.get(job.precision.dtype, 2)
    dense, expert = a * rp.dense, a * rp.expert
    if job.precision.fp8 and job.precision.fp8_param:
        dense -= (a - 1) * (rp.gemm - rp.expert_gemm)
        expert -= (a - 1) * rp.expert_gemm
    return dense, expert


def main_param_bytes(pr) -> int:
    """Bytes of one main (master) parameter: precision.main_params_dtype's (the precision-aware optimizer; fp32
    unless asked), fp32 when the model itself trains in fp32."""
    return OPTIMIZER_STATE_BYTES[pr.main_params_dtype] if pr.dtype != "fp32" else 4


def optimizer_host_bytes(job: JobConfig, rp: RankParams, lay: Layout) -> float:
    """train.optimizer_cpu_offload: what the host holds for the rank's offloaded share of its optimizer shard.
    HybridDeviceOptimizer (hybrid_optimizer.py ``_get_sub_optimizer_param_groups``) clones each offloaded main
    parameter into pinned host memory, keeps its Adam moments there (the host optimizer's state) and a pinned copy of
    its gradient (``cpu_copy_map_grad``), all in the main parameters' dtype."""
    pr = job.precision
    main = main_param_bytes(pr)
    dense_shards, expert_shards = optimizer_shards(job, lay)
    elements = (rp.dense / dense_shards + rp.expert / expert_shards) * job.train.optimizer_offload_fraction
    # main parameter + gradient copy, two moments
    return elements * (2 * main + OPTIMIZER_STATE_BYTES[pr.exp_avg_dtype] + OPTIMIZER_STATE_BYTES[pr.exp_avg_sq_dtype])


def static_bytes(job: JobConfig, rp: RankParams, lay: Layout | None = None) -> dict[str, float]:
    """Weights, fp32 gradients, optimizer state (master copy + Adam) and FP8 weight copies."""
    pr = job.precision
    a = DTYPE_BYTES.get(pr.dtype, 2)
    # Megatron-FSDP keeps fp32 main weights in a buffer of their own even for an fp32 model
    # (megatron_fsdp_main_params_dtype, fp32 by default; measured: tests/test_fsdp.py)
    opt_per_param = ADAM_STATE_BYTES + (MASTER_BYTES if pr.dtype != "fp32" or job.parallel.megatron_fsdp else 0)
    if pr.precision_aware_optimizer:
        # Megatron-Core's precision-aware optimizer stores the moments and the main weights in the dtypes asked
        # (optimizer_config.py exp_avg_dtype / exp_avg_sq_dtype / main_params_dtype; fp8 moments are 1 byte);
        # bf16 main gradients are the bf16 grad buffer, counted in grads below (validate: grad_reduce_in_fp32=false)
        opt_per_param = (OPTIMIZER_STATE_BYTES[pr.exp_avg_dtype] + OPTIMIZER_STATE_BYTES[pr.exp_avg_sq_dtype]
                         + (OPTIMIZER_STATE_BYTES[pr.main_params_dtype] if pr.dtype != "fp32" else 0))
    if job.train.optimizer_cpu_offload:
        # HybridDeviceOptimizer (hybrid_optimizer.py) keeps the first optimizer_offload_fraction of the state's
        # elements, main weights and moments, on the host; the GPU holds the rest
        opt_per_param *= 1.0 - job.train.optimizer_offload_fraction
    dense_shards, expert_shards = optimizer_shards(job, lay or derive(job))
    weight_bytes = sum(param_bytes(job, rp))
    fp8 = 0.0
    if pr.fp8:  # layer GEMM weights only: rp.gemm excludes the output layer
        if pr.fp8_param:
            fp8 = rp.gemm  # the transpose, 1 byte
        else:
            fp8 = FP8_WEIGHT_COPY_BYTES * rp.gemm
    grads = (GRAD_BYTES_FP32 if pr.grad_reduce_in_fp32 else a) * rp.total
    if job.parallel.megatron_fsdp and rp.total:  # ZeRO-3: weights and gradients sharded like the optimizer
        shard = (rp.dense / dense_shards + rp.expert / expert_shards) / rp.total
        weight_bytes, grads, fp8 = weight_bytes * shard, grads * shard, fp8 * shard
        # ... except the weights outside its units (TransformerLayer): the embedding and output layer are
        # all-gathered once per step and stay unsharded through forward and backward (megatron_fsdp
        # param_and_grad_buffer.py release_bucket: "Non-unit modules should remain persistently allocated")
        weight_bytes += a * rp.embedding
    return {
        "weights": weight_bytes,
        "grads": grads,
        "optimizer": opt_per_param * (rp.dense / dense_shards + rp.expert / expert_shards),
        "fp8_weights": fp8,
    }


def fsdp_layer_params(job: JobConfig, lay: Layout) -> float:
    """Parameters of the largest layer on one rank before FSDP sharding (what one all-gather unshards)."""
    kinds = set(lay.moe_pattern) or {False}
    best = 0.0
    for moe in kinds:
        lp = layer_params(job.model, moe)
        best = max(best, lp.tp_sharded / lay.tp + lp.replicated + lp.expert / (lay.ep * lay.etp))
    return best


def stage_memory(job: JobConfig, lay: Layout, stage: int, cache: dict | None = None,
                 static_cache: dict | None = None, zb_exact: bool | str = True) -> StageMemory:
    """Peak memory of one rank of ``stage``. ``cache``: shared by the stages of one job, so stages alike reuse
    the per-layer activation sums; ``static_cache``: shared by jobs that differ only in micro batch and
    recomputation (the search), for the layer split and the weights, gradients and optimizer state;
    ``zb_exact=False``: a zero-bubble schedule's states from ``zb_v_bound_states`` / ``zb_h1_bound_states`` (upper
    bounds) instead of its op list; ``zb_exact="reached"``: ZB-H1's from ``zb_h1_reached_states`` (a lower bound)."""
    model = job.model
    cache = {} if cache is None else cache
    static_cache = {} if static_cache is None else static_cache
    p, t, cp = lay.pp, lay.tp, lay.cp
    if ("stage", stage) not in static_cache:
        layers = stage_layers(lay, stage)
        static_cache[("stage", stage)] = (len(layers), sum(1 for i in layers if lay.moe_pattern[i]))
    n_layers, n_moe = static_cache[("stage", stage)]
    last = stage == loss_rank(job.schedule.kind, p)
    key = (stage == 0, last, n_moe, n_layers)
    if key not in static_cache:
        rp = stage_params(job, stage, lay)
        static_cache[key] = (rp, static_bytes(job, rp, lay))  # FP8 copies: layer GEMMs only (output layer BF16)
    rp, static = static_cache[key]
    parts = dict(static)

    def per_token(kind: bool, full: bool = False) -> float:
        if ("act", kind, full) not in cache:
            cache[("act", kind, full)] = layer_activation_bytes_per_token(job, lay, kind, full=full)
        return cache[("act", kind, full)]
    a = DTYPE_BYTES.get(job.precision.dtype, 2)
    sp = sp_shards(lay)
    b, s, h = job.train.micro_batch_size, model.seq_length, model.hidden_size
    tokens = b * s / cp
    pattern = lay.moe_pattern
    counts = {True: n_moe, False: n_layers - n_moe}
    frac = recompute_fraction(job, lay, n_layers)
    per_kind = {k: frac * per_token(k) + (1 - frac) * per_token(k, True) for k, n in counts.items() if n}
    mtp = model.mtp_num_layers if last else 0
    per_mb = sum(n * per_kind[k] for k, n in counts.items() if n) * tokens
    per_mb_mtp = mtp * (per_token(pattern[-1]) + 3 * a * h / sp) * tokens
    if stage == 0:
        per_mb += 8 * tokens + (h * tokens / sp if model.hidden_dropout > 0 else 0)  # token ids; emb dropout
    in_flight = in_flight_microbatches(job, lay, stage)
    logits = 0.0
    if last:
        vp = lay.padded_vocab
        logits += 2 * a * h * tokens / sp  # final norm input + output-layer input
        logits += tokens * vp / t * logit_bytes(job, mtp)
    pending = None
    if job.schedule.kind in Schedule.ZERO_BUBBLE and p > 1:  # the op list's state of most memory, pending W's counted
        if ("wgrad", last, n_moe, n_layers) not in cache:
            cache[("wgrad", last, n_moe, n_layers)] = stage_wgrad_bytes(job, lay, stage)
        w_mb = cache[("wgrad", last, n_moe, n_layers)]
        if job.schedule.kind == Schedule.ZB_V:  # states count chunk-microbatches, each half of the rank's layers
            costs = tuple(job.schedule.zb_v_costs or (1.0, 1.0, 1.0))
            held = (zb_v_front(p, max(1, lay.microbatches), costs)[stage] if zb_exact
                    else zb_v_bound_states(p, max(1, lay.microbatches)))
            states = tuple((f / 2, w / 2) for f, w in held)
        else:  # over a virtual pipeline: chunk-microbatches, each 1/v of the rank's layers
            args = (p, max(1, lay.microbatches), lay.vpp, lay.microbatch_group if lay.vpp > 1 else None)
            if zb_exact == "reached":
                held = zb_h1_reached_states(*args)[stage]
            else:
                held = zb_h1_front(*args)[stage] if zb_exact else zb_h1_bound_states(*args)[stage]
            states = held if lay.vpp == 1 else tuple((f / lay.vpp, w / lay.vpp) for f, w in held)
        in_flight, n_pending = zb_peak_state(states, per_mb, w_mb, logits)
        logits = logits if in_flight else 0.0
        pending = n_pending * w_mb
    parts["activations"] = per_mb * in_flight + per_mb_mtp
    host = {"optimizer": optimizer_host_bytes(job, rp, lay)} if job.train.optimizer_cpu_offload else {}
    if job.train.activation_offload_modules and pending is None:
        if ("offload",) not in cache:
            cache[("offload",)] = {k: offloaded_bytes_per_token(job, lay, k) for k in (False, True)}
        off = cache[("offload",)]
        freed = sum(n * off[k][0] for k, n in counts.items() if n) * tokens
        # every microbatch in flight leaves its offloaded tensors on the host but one layer's: the group reloaded
        # ahead of its backward (bulk_reload_group prefetches the next; the last group of each name is kept,
        # post_warmup_callback's offload margin)
        resident = max((off[k][0] for k, n in counts.items() if n), default=0.0) * tokens
        parts["activations"] -= max(0.0, freed * in_flight - resident)
        host["activations"] = sum(n * off[k][1] for k, n in counts.items() if n) * tokens * in_flight
    parts["output_logits"] = logits
    if pending is not None:
        parts["pending_wgrad"] = pending
    comm = 0.0
    if p > 1:
        comm += 2 * 2 * a * h * tokens / sp  # p2p send/recv buffers, both directions
    if sp > 1:
        comm += a * h * tokens  # SP all-gather buffer (Megatron GlobalMemoryBuffer)
    if model.num_experts and lay.ep > 1:
        comm += 2 * model.moe_router_topk * a * h * tokens / sp  # all-to-all dispatch send + receive
    if cp > 1 and not model.multi_latent_attention:
        comm += 2 * 2 * a * query_groups(model) * kv_channels(model) * tokens / t  # ring K/V send + recv
    if job.parallel.megatron_fsdp:  # two layers unsharded (current + prefetched) and one layer's full gradients
        w_bytes = 1 if job.precision.fp8_param else a
        g_bytes = GRAD_BYTES_FP32 if job.precision.grad_reduce_in_fp32 else a
        comm += (2 * w_bytes + g_bytes) * fsdp_layer_params(job, lay)
    parts["comm_buffers"] = comm
    parts["cuda_graphs"] = cuda_graph_bytes(job, lay, n_layers - n_moe, n_moe)
    # The backward of one layer: its activation gradients (and, under full recompute, its recomputed forward).
    work = max((per_token(k, True) for k in per_kind), default=0.0) * tokens
    parts["workspace"] = work * (2 if frac > 0 else 1)
    parts["reserve"] = job.cluster.memory_reserve_gb * GB
    return StageMemory(stage, n_layers, rp.total, in_flight, parts, n_pending if pending is not None else 0, host)


GRAPH_BUFFERS_PER_CALLABLE = 2
"""Static hidden-size buffers one graphed callable adds: the backward graph's output-gradient input and
input-gradient output (Megatron-Core cuda_graphs.py ``_CudaGraphRunner.create_bwd_graph``; TE
make_graphed_callables' static grad buffers). One set per callable, not per microbatch: backward graphs replay one
at a time and share these (TE >= 2.7 ``_reuse_graph_input_output_buffers``; Megatron-Core's local graphs are
captured in execution order into one mempool). The forward graph's static input and output are not counted again:
the input is the layer input the eager count already holds for backward, the output the next callable's input."""


def graphed_callables(job: JobConfig, moe_layer: bool) -> int:
    """CUDA graphs one layer is cut into under train.cuda_graph_modules: the whole layer (empty list) is one;
    otherwise attention is one and the MLP part (mlp on a dense layer; moe, or moe_router with moe_preprocess, on
    an MoE layer) another (Megatron-Core ``_layer_is_graphable`` / ``create_mcore_cudagraph_manager``)."""
    mods = set(job.train.cuda_graph_modules)
    if not mods:
        return 1
    mlp = bool(mods & {"moe", "moe_router", "moe_preprocess"}) if moe_layer else "mlp" in mods
    return int("attn" in mods) + int(mlp)


def cuda_graph_bytes(job: JobConfig, lay: Layout, n_dense: int, n_moe: int) -> float:
    """train.cuda_graph_impl: the graphs' static buffers beyond the eager activations, ``GRAPH_BUFFERS_PER_CALLABLE``
    hidden-size tensors of one microbatch for every graphed callable of the stage. The activations captured inside
    the graphs are the eager activations, already counted. An estimate from the code (launcher/plan/NOTES.md), not
    yet measured on a GPU."""
    if job.train.cuda_graph_impl == "none":
        return 0.0
    a = DTYPE_BYTES.get(job.precision.dtype, 2)
    tokens = job.train.micro_batch_size * job.model.seq_length / lay.cp
    hidden = a * job.model.hidden_size * tokens / sp_shards(lay)
    callables = n_dense * graphed_callables(job, False) + n_moe * graphed_callables(job, True)
    return GRAPH_BUFFERS_PER_CALLABLE * hidden * callables


def host_fits(job: JobConfig, stages: list[StageMemory], per_node: float = 0.0) -> bool:
    """Whether a node can hold what its ranks offload: the busiest stage's host bytes on every GPU of the node, plus
    ``per_node`` (an async checkpoint save's staging copy), within cluster.host_memory_gb (null: not checked)."""
    limit = job.cluster.host_memory_gb
    return limit is None or max(s.host_bytes for s in stages) * job.cluster.gpus_per_node + per_node <= limit * GB


def memory_per_stage(job: JobConfig, lay: Layout | None = None, static_cache: dict | None = None,
                     zb_exact: bool | str = True) -> list[StageMemory]:
    """Peak memory of every pipeline stage (``lay``: the job's layout, derived if None; ``static_cache``,
    ``zb_exact``: see ``stage_memory``)."""
    lay = lay or derive(job)
    cache: dict = {}
    static_cache = {} if static_cache is None else static_cache
    return [stage_memory(job, lay, r, cache, static_cache, zb_exact) for r in range(lay.pp)]


def activation_formula_check(job: JobConfig) -> float:
    """Per-layer activation bytes for one microbatch divided by s*b*h (the Korthikanti coefficient)."""
    model, lay = job.model, derive(job)
    s, b, h = model.seq_length, job.train.micro_batch_size, model.hidden_size
    per_tok = layer_activation_bytes_per_token(job, lay, False)
    return per_tok * b * s / lay.cp / (s * b * h)


def param_count(model: ModelConfig) -> dict[str, float]:
    """Parameter counts (unpadded vocabulary): dense, expert, embedding and total as ``model_params``; ``mtp``
    (the MTP modules, sharing the main model's embedding and output layer), ``main`` (total without them) and
    ``active`` (main-model parameters one token passes through: every non-expert one, top-k of the experts)."""
    counts = model_params(model, tp=1, padded_vocab=model.vocab_size).as_dict()
    mtp_model = dataclasses.replace(model, mtp_num_layers=0)
    main = model_params(mtp_model, tp=1, padded_vocab=model.vocab_size)
    routed = model.moe_router_topk / model.num_experts if model.num_experts else 0.0
    return {**counts, "main": main.total, "mtp": counts["total"] - main.total,
            "active": main.dense + main.expert * routed}
