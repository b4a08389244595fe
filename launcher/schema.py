"""The typed job schema: the single source of truth for every field a recipe may set.
One room (~600 lines): every section's dataclass and the names code branches on, with each field's docstring,
which ``--help`` reads from this file's source; one file is the one place a new field is declared.

Recipes (YAML under ``recipes/``) only choose values for these fields; Hydra's struct mode rejects any key
that is not declared here. Each section is its own dataclass so that builders can take exactly the
sub-config they need (``build_model(model=..., parallel=..., precision=...)``), never the root.

Attribute docstrings (the string literal under each field) are the field's documentation: ``--help``
reads them from this file's source, so keep one under every field.

This module is imported on the login node: it must not import torch or megatron.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple



class Schedule:
    """The pipeline schedules (``schedule.kind``) by name: code branches on these names, never on a literal
    (tests/test_named_literals.py)."""

    ONE_F_ONE_B, INTERLEAVED, ZB_H1, ZB_V = "1f1b", "interleaved", "zb_h1", "zb_v"
    ZERO_BUBBLE = (ZB_H1, ZB_V)
    """Ours (no upstream schedule): the backward split into B (input gradient) and W (weight gradient, deferred)."""


class Recompute:
    """Activation recomputation (``train.recompute``; Megatron's recompute_granularity, same spelling) by name."""

    NONE, SELECTIVE, FULL = "none", "selective", "full"


class Profiler:
    """The profilers (``profile.kind``) by name."""

    NONE, NSYS, TORCH = "none", "nsys", "torch"


# ---- Allowed values, declared once. Validation reads them from the field metadata (``choices_of``); the rank
# side maps each name to its Megatron-Core value and a test checks the maps cover exactly these names.
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
ACTIVATIONS = ("swiglu", "gelu", "squared_relu")
POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")
MOE_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_DISPATCHERS = ("alltoall", "allgather", "flex")
MOE_FLEX_BACKENDS = ("deepep", "hybridep")
SCHEDULES = (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED, Schedule.ZB_H1, Schedule.ZB_V)
DTYPES = ("bf16", "fp16", "fp32")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
# Megatron-LM arguments.py: --main-grads-dtype {fp32,bf16}, --main-params-dtype {fp32,fp16},
# --exp-avg-dtype / --exp-avg-sq-dtype {fp32,fp16,bf16,fp8} (fp8 is torch.uint8 there)
OPTIMIZER_GRAD_DTYPES = ("fp32", "bf16")
OPTIMIZER_PARAM_DTYPES = ("fp32", "fp16")
OPTIMIZER_STATE_DTYPES = ("fp32", "fp16", "bf16", "fp8")
FP8_FORMATS = ("hybrid", "e4m3")
FP8_AMAX_ALGOS = ("max", "most_recent")
TE_CHOICES = ("auto", "true", "false")
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
RECOMPUTE = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
# Megatron-Core 0.19.2 transformer_config.py cuda_graph_impl / cuda_graph_modules (CudaGraphModule; "mamba" is for
# hybrid models, not built here). full_iteration (FullCudaGraphWrapper around the whole forward-backward) needs the
# training loop to wrap the schedule; not built here.
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine")
CUDA_GRAPH_MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess")
# Megatron-Core 0.19.2 transformer_config.py offload_modules (fine-grained activation offloading): the modules whose
# saved inputs go to pinned host memory. fused_group_mlp needs use_transformer_engine_op_fuser (not built here).
ACTIVATION_OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act",
                              "fused_group_mlp")
DATA_KINDS = ("indexed", "mock")
CHECKPOINT_FORMATS = ("torch_dist",)
CHECKPOINT_VERIFY = ("sizes", "checksum")
OPTIMIZER_FORMATS = ("dp_reshardable", "fully_reshardable")
NONFINITE_POLICIES = ("stop", "skip")
WANDB_MODES = ("offline", "online", "disabled")
LAUNCHERS = ("slurm", "local")
GPUS = ("H100", "H200", "GH200", "B200", "GB200", "A100", "cpu")
BACKENDS = ("nccl", "gloo")
ACTIONS = ("default", "render", "submit", "run", "plan", "search", "validate", "megatron-args", "list", "bench")
PROFILERS = (Profiler.NONE, Profiler.NSYS, Profiler.TORCH)


def choice(default: Any, allowed: Tuple[Any, ...], *, nullable: bool = False):
    """A field whose value must be one of ``allowed`` (null too when ``nullable``); the rule lives here."""
    assert default in allowed or (nullable and default is None), (default, allowed)
    return field(default=default, metadata={"choices": allowed, "nullable": nullable})


def choices_of(cls: type, name: str) -> Optional[Tuple[Any, ...]]:
    """The allowed values of field ``name`` of schema class ``cls`` (None: not a choice field)."""
    for f in cls.__dataclass_fields__.values():
        if f.name == name:
            return f.metadata.get("choices")
    raise KeyError(name)


@dataclass
class ModelConfig:
    """Architecture of the decoder-only transformer (Megatron-Core GPTModel)."""

    name: str = "smoke"
    """Architecture name, for logs and reports."""
    num_layers: int = 4
    """Number of transformer layers (decoder blocks), excluding MTP layers."""
    hidden_size: int = 128
    """Model width (d_model)."""
    ffn_hidden_size: int = 512
    """Width of the dense MLP (per projection for SwiGLU)."""
    num_attention_heads: int = 4
    """Number of query heads."""
    num_query_groups: Optional[int] = None
    """Number of key/value heads for grouped-query attention; null means multi-head attention (= heads)."""
    kv_channels: Optional[int] = None
    """Per-head dimension; null means hidden_size / num_attention_heads."""
    vocab_size: int = 8192
    """Tokenizer vocabulary size (unpadded); the embedding is padded to make_vocab_size_divisible_by x TP."""
    make_vocab_size_divisible_by: int = 128
    """Pad the embedding rows to a multiple of this (times the tensor-parallel size)."""
    seq_length: int = 256
    """Training sequence length in tokens."""
    max_position_embeddings: Optional[int] = None
    """Maximum positions for learned embeddings / RoPE tables; null means seq_length."""
    normalization: str = choice("RMSNorm", NORMALIZATIONS)
    """Normalization layer: RMSNorm or LayerNorm."""
    norm_epsilon: float = 1e-5
    """Epsilon of the normalization layers."""
    activation: str = choice("swiglu", ACTIVATIONS)
    """MLP activation: swiglu (gated SiLU), gelu, or squared_relu."""
    position_embedding: str = choice("rope", POSITION_EMBEDDINGS)
    """Position embedding: rope, learned_absolute, or none."""
    rotary_base: float = 500000.0
    """RoPE base frequency (theta)."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates."""
    rope_scaling: bool = False
    """Apply Llama-3.1 style RoPE frequency scaling (long-context)."""
    rope_scaling_factor: float = 8.0
    """Llama-3.1 RoPE scaling factor (used when rope_scaling is true)."""
    tie_embeddings: bool = False
    """Share the input embedding and output projection weights (Llama 3 unties them)."""
    add_bias_linear: bool = False
    """Bias terms in all linear layers (GPT-3 style uses them; Llama does not)."""
    add_qkv_bias: bool = False
    """Bias in the QKV projection only (Qwen2 style)."""
    qk_layernorm: bool = False
    """Normalize queries and keys per head (Qwen3 style)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    hidden_dropout: float = 0.0
    """Dropout on residual branches."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    # --- Mixture of Experts -------------------------------------------------------------------------
    num_experts: Optional[int] = None
    """Routed experts per MoE layer; null means a dense model."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: Optional[int] = None
    """Width of each routed expert's MLP; null means ffn_hidden_size."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Total width of the shared expert(s); null means no shared expert."""
    moe_layer_freq: int = 1
    """Every n-th layer is MoE (1 = all layers after the first dense ones)."""
    moe_first_k_dense: int = 0
    """The first k layers use a dense MLP (DeepSeek-V3 uses 3)."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing auxiliary loss coefficient."""
    moe_router_load_balancing_type: str = choice("aux_loss", MOE_LOAD_BALANCING)
    """Load balancing: aux_loss, seq_aux_loss, sinkhorn, or none."""
    moe_router_score_function: str = choice("softmax", MOE_SCORE_FUNCTIONS)
    """Router score function: softmax or sigmoid."""
    moe_token_dispatcher_type: str = choice("alltoall", MOE_DISPATCHERS)
    """Token dispatcher: alltoall, allgather, or flex (DeepEP / HybridEP kernels: a token crosses the network
    once per destination node and fans out over NVLink there; GPU only, the kernels come with the image)."""
    moe_flex_dispatcher_backend: str = choice("deepep", MOE_FLEX_BACKENDS)
    """Kernels behind moe_token_dispatcher_type=flex: deepep, or hybridep (NVIDIA's DeepSeek-V3 H100 recipe)."""
    moe_grouped_gemm: bool = True
    """Use grouped GEMM for experts (GPU only; ignored on CPU)."""
    moe_router_num_groups: Optional[int] = None
    """Expert groups for group-limited routing (DeepSeek-V3: 8; one group per node of the EP group makes it
    node-limited); null means no groups. Set with moe_router_group_topk."""
    moe_router_group_topk: Optional[int] = None
    """Groups each token's experts may come from under group-limited routing (DeepSeek-V3: 4)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """Factor on the selected experts' routing weights (DeepSeek-V3: 2.5); null means 1."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free load balancing (DeepSeek-V3): a per-expert bias, updated from the experts' loads, is added
    to the scores when choosing the top-k; sigmoid scores only."""
    moe_expert_capacity_factor: Optional[float] = None
    """Token dropping: each expert takes at most this multiple of its balanced share of tokens and drops the
    rest (NVIDIA's "tokendrop" runs use 1.0); null means dropless."""
    moe_pad_expert_input_to_capacity: bool = False
    """Pad every expert's input to its capacity (fixed shapes); needs moe_expert_capacity_factor."""
    # --- Multi-latent attention (DeepSeek) ----------------------------------------------------------
    multi_latent_attention: bool = False
    """Use multi-latent attention instead of standard attention."""
    q_lora_rank: Optional[int] = None
    """Query low-rank dimension for MLA; null means no query compression."""
    kv_lora_rank: int = 512
    """Key/value low-rank dimension for MLA."""
    qk_head_dim: int = 128
    """MLA query/key head dimension (without the RoPE part)."""
    qk_pos_emb_head_dim: int = 64
    """MLA query/key RoPE head dimension."""
    v_head_dim: int = 128
    """MLA value head dimension."""
    # --- Multi-token prediction ---------------------------------------------------------------------
    mtp_num_layers: int = 0
    """Multi-token-prediction layers (DeepSeek-V3 uses 1)."""
    cross_entropy_loss_fusion: bool = False
    """Megatron-Core's fused vocab-parallel cross entropy ('native' implementation): keeps the softmax in the
    logits dtype (bf16) instead of fp32, halving the last stage's loss memory (NVIDIA's performance recipes)."""


@dataclass
class ParallelConfig:
    """Parallel layout. Their product (with data parallel) equals the world size."""

    tensor: int = 1
    """Tensor-parallel size (TP); must fit inside one node's NVLink domain."""
    pipeline: int = 1
    """Pipeline-parallel size (PP)."""
    virtual_pipeline: Optional[int] = None
    """Virtual pipeline stages per pipeline rank (VPP, interleaved schedule); null means 1."""
    context: int = 1
    """Context-parallel size (CP), splitting the sequence; needs Transformer Engine attention."""
    expert: int = 1
    """Expert-parallel size (EP) for MoE layers."""
    expert_tensor: Optional[int] = None
    """Tensor-parallel size inside experts (ETP); null means equal to tensor."""
    data: Optional[int] = None
    """Data-parallel size; derived from the world size. Set it only to assert the expected value."""
    sequence_parallel: bool = False
    """Shard LayerNorm/dropout activations along the sequence over the TP group (SP)."""
    distributed_optimizer: bool = True
    """Shard optimizer state and master weights over data-parallel ranks (ZeRO-1 style)."""
    megatron_fsdp: bool = False
    """Megatron-Core FSDP (use_megatron_fsdp, sharding strategy optim_grads_params; ZeRO-3 in the usual terms):
    parameters, gradients and optimizer state sharded over DP x CP, each layer's parameters all-gathered in
    forward and backward and its gradients reduce-scattered, overlapped with compute (on GPU; on CPU the same
    Megatron-FSDP code runs over gloo without overlap). Needs distributed_optimizer and (in this launcher)
    parallel.pipeline=1; checkpoints are written in the fsdp_dtensor format."""
    overlap_grad_reduce: bool = True
    """Overlap the data-parallel gradient reduce-scatter with backward (GPU)."""
    overlap_param_gather: bool = True
    """Overlap the distributed optimizer's parameter all-gather with forward (GPU)."""
    tp_comm_overlap: bool = False
    """Overlap tensor-parallel all-gather/reduce-scatter with the GEMMs (Transformer Engine userbuffers;
    GPU only, needs sequence_parallel and tensor > 1)."""
    first_stage_layers: Optional[int] = None
    """Layers on the first pipeline stage for an uneven split; null means an even split."""
    last_stage_layers: Optional[int] = None
    """Layers on the last pipeline stage for an uneven split; null means an even split."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the input embedding as one layer when splitting the pipeline (Megatron-Core's flag): the layers
    + 1 split evenly over PP x VPP chunks and the first chunk holds one decoder layer fewer (NVIDIA's 405B,
    Qwen3-235B layouts); not with first/last_stage_layers."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the output layer + loss as one layer when splitting the pipeline: the last chunk of the last
    stage holds one decoder layer fewer; not with first/last_stage_layers."""
    pipeline_model_parallel_layout: Optional[str] = None
    """Explicit layers per virtual pipeline stage, Megatron-Core's string: '|' between virtual stages (PP x VPP
    of them, in virtual-stage order), E embedding, t decoder layer, m MTP layer, L loss, (..)*n repeats;
    e.g. DeepSeek-V3 on PP8 x VPP4: 'Et|(tt|)*30mL'. Excludes the other split fields; null means none."""
    moe_a2a_overlap: bool = False
    """Overlap the MoE expert-parallel all-to-all with another microbatch's computation (Megatron-Core's
    overlap_moe_expert_parallel_comm, the combined 1F1B schedule; GPU only; needs EP > 1, virtual pipeline
    stages when PP > 1, the alltoall or flex dispatcher, no full recompute, at most one MTP layer). action=search
    keeps this choice (it never switches the overlap on: the planner does not price its host-side cost)."""


@dataclass
class ScheduleConfig:
    """Pipeline schedule."""

    kind: str = choice(Schedule.ONE_F_ONE_B, SCHEDULES)
    """Pipeline schedule: 1f1b, interleaved (needs virtual_pipeline > 1), zb_h1 (zero bubble) or zb_v (zero
    bubble over two model chunks per rank placed in a V; needs virtual_pipeline = 2)."""
    microbatch_group_size: Optional[int] = None
    """Interleaved: microbatches run per virtual stage before switching; null means the pipeline size."""
    batch_p2p_comm: bool = True
    """Batch pipeline send/recv into one call. Interleaved with PP=2 needs false (upstream bug)."""
    overlap_p2p_comm: bool = False
    """Overlap pipeline send/recv with compute (interleaved only)."""
    record_timeline: bool = False
    """Record what each rank executed in the last training step (wall-clock start/end of every F, B, W, send
    and recv) into the bundle's timeline/ as a Chrome/Perfetto trace JSON and a PNG (1f1b, zb_h1, zb_v)."""
    zb_v_costs: Optional[List[float]] = None
    """zb_v: the relative per-chunk [T_F, T_B, T_W] its op order is generated for (launcher/core/pipeline/schedules.py
    schedule_zb_v; ranks and planner use the same order): three numbers for every stage, or 6 x parallel.pipeline
    (one triple per pipeline stage 0..2PP-1 in model order; stage s runs on rank s, or 2PP-1-s for s >= PP, so
    rank 0 holds the first and the last); null means equal costs. ``action=plan`` prints the
    planner's estimate for the job, and ``action=search`` sets it on its zb_v candidates."""


@dataclass
class PrecisionConfig:
    """Numerics: training dtype and FP8."""

    dtype: str = choice("bf16", DTYPES)
    """Parameter/compute dtype: bf16, fp16 or fp32."""
    fp8: Optional[str] = choice(None, FP8_RECIPES, nullable=True)
    """FP8 recipe: delayed, tensorwise, blockwise (Hopper+) or mxfp8 (Blackwell); null disables FP8."""
    fp8_format: str = choice("hybrid", FP8_FORMATS)
    """FP8 format: hybrid (E4M3 forward, E5M2 backward) or e4m3."""
    fp8_param: bool = False
    """Keep parameters in FP8 (saves the BF16 weight copy; needs FP8)."""
    fp8_amax_history_len: int = 1024
    """Delayed scaling: amax history length."""
    fp8_amax_compute_algo: str = choice("max", FP8_AMAX_ALGOS)
    """Delayed scaling: max or most_recent."""
    transformer_engine: str = choice("auto", TE_CHOICES)
    """Use Transformer Engine layers: auto (on when the cluster has GPUs), true, or false."""
    grad_reduce_in_fp32: bool = True
    """Keep gradient buffers and their data-parallel reduction in fp32 (Megatron's default with bf16);
    false keeps them in the parameter dtype (NVIDIA's performance recipes), saving 2 bytes per parameter."""
    precision_aware_optimizer: bool = False
    """Megatron-Core's precision-aware optimizer (use_precision_aware_optimizer: TE's FusedAdam, or with
    train.optimizer_cpu_offload the hybrid CPU/GPU optimizer): main weights, main gradients and Adam moments may
    be kept in the lower-precision dtypes below. Needs the distributed optimizer."""
    main_grads_dtype: str = choice("fp32", OPTIMIZER_GRAD_DTYPES)
    """Precision-aware optimizer: dtype of the main gradients (bf16 needs precision.grad_reduce_in_fp32=false)."""
    main_params_dtype: str = choice("fp32", OPTIMIZER_PARAM_DTYPES)
    """Precision-aware optimizer: dtype of the main (master) weights."""
    exp_avg_dtype: str = choice("fp32", OPTIMIZER_STATE_DTYPES)
    """Precision-aware optimizer: dtype Adam's first moment is stored in (fp8 = one byte, scaled by TE)."""
    exp_avg_sq_dtype: str = choice("fp32", OPTIMIZER_STATE_DTYPES)
    """Precision-aware optimizer: dtype Adam's second moment is stored in."""

    def __post_init__(self) -> None:
        # Hydra parses `precision.transformer_engine=false` as a boolean, which the str field stores as "False".
        if isinstance(self.transformer_engine, (bool, str)):
            self.transformer_engine = str(self.transformer_engine).lower()


@dataclass
class TrainConfig:
    """Batch sizes, length of the run, optimizer and LR schedule."""

    micro_batch_size: int = 1
    """Sequences per microbatch per data-parallel rank."""
    global_batch_size: int = 8
    """Sequences per optimizer step across all data-parallel ranks."""
    train_steps: Optional[int] = 20
    """Optimizer steps; exactly one of train_steps and train_tokens is set."""
    train_tokens: Optional[int] = None
    """Train for this many tokens instead (rounded up to whole steps)."""
    lr: float = 3.0e-4
    """Peak learning rate."""
    min_lr: float = 3.0e-5
    """Final learning rate of the decay."""
    lr_schedule: str = choice("cosine", LR_SCHEDULES)
    """LR decay: cosine, linear, constant or wsd (warmup-stable-decay)."""
    warmup_steps: int = 0
    """Linear warmup steps."""
    wsd_decay_steps: Optional[int] = None
    """WSD: steps of the final decay phase; null means 10% of the run."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    adam_eps: float = 1.0e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    optimizer_cpu_offload: bool = False
    """Keep (a fraction of) the optimizer state and its Adam step on the host CPU (Megatron-Core's
    HybridDeviceOptimizer); needs precision.precision_aware_optimizer (Megatron-LM asserts it)."""
    optimizer_offload_fraction: float = 1.0
    """With optimizer_cpu_offload: the share of the optimizer state moved to the host (Megatron-LM's default 1.0)."""
    overlap_cpu_optimizer_d2h_h2d: bool = False
    """With optimizer_cpu_offload: overlap the host Adam step with the gradient download and parameter upload."""
    seed: int = 1234
    """Random seed for initialisation and data order."""
    eval_interval: int = 0
    """Evaluate on the validation split every n steps (0 disables periodic eval)."""
    eval_iters: int = 2
    """Validation batches per evaluation."""
    recompute: str = choice(Recompute.SELECTIVE, RECOMPUTE)
    """Activation recomputation: none, selective (core attention) or full."""
    recompute_num_layers: Optional[int] = None
    """Full recompute: layers per stage recomputed; null means all."""
    recompute_modules: List[str] = field(default_factory=list)
    """Selective recompute: the submodules recomputed in backward (Megatron-Core's recompute_modules: core_attn,
    moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts); empty means core_attn (Megatron's default)."""
    cuda_graph_impl: str = choice("none", CUDA_GRAPH_IMPLS)
    """CUDA graphs for the transformer layers (Megatron-Core's cuda_graph_impl): none; local (Megatron-Core's
    CudaGraphManager captures each layer's forward and backward per microbatch after cuda_graph_warmup_steps eager
    runs and replays them; graphs are built inside Megatron-Core's 1F1B / interleaved schedules); or
    transformer_engine (TE's make_graphed_callables, captured once by the training loop at step
    cuda_graph_warmup_steps). Removes the host's kernel-launch time of what they cover; costs a static memory pool
    (see the plan). GPU only; not with the zero-bubble schedules."""
    cuda_graph_modules: List[str] = field(default_factory=list)
    """With cuda_graph_impl: which parts of each layer are captured (Megatron-Core's cuda_graph_modules, formerly
    cuda_graph_scope): attn, mlp (dense layers), moe (whole MoE block; drop-and-pad MoE only), moe_router (up to
    the router, with shared experts), moe_preprocess (with moe_router). Empty captures the whole layer."""
    cuda_graph_warmup_steps: int = 3
    """With cuda_graph_impl: eager steps (local: runs per graph) before capture (Megatron-Core's default 3)."""
    activation_offload_modules: List[str] = field(default_factory=list)
    """Fine-grained activation offloading (Megatron-Core's fine_grained_activation_offloading with offload_modules):
    the modules whose saved-for-backward tensors are copied to pinned host memory on a side stream during the
    forward and reloaded ahead of their backward: attn_norm (MLA layers; the TE spec fuses the others' norm into
    qkv_linear), qkv_linear, core_attn, attn_proj (with core_attn), mlp_norm (MoE layers), expert_fc1, moe_act.
    Empty: off. GPU with Transformer Engine only; not with the zero-bubble schedules or local CUDA graphs."""
    activation_offload_fraction: float = 1.0
    """With activation_offload_modules: the share of each model chunk's offload groups actually offloaded (the
    later ones are kept on the GPU; Megatron-Core's activation_offload_fraction)."""
    min_offloaded_tensor_size: int = 1048576
    """With activation_offload_modules: tensors with fewer elements stay on the GPU (Megatron-Core's default 2^20)."""
    exit_after_minutes: Optional[float] = None
    """Stop cleanly (with a checkpoint) after this wall time; null means no limit."""
    nonfinite: str = choice("stop", NONFINITE_POLICIES)
    """A NaN/Inf loss or gradient norm: stop (exit non-zero at that step, no checkpoint saved after it) or
    skip (drop that step's update: parameters, optimizer state and LR schedule stay as they were)."""
    spike_factor: Optional[float] = None
    """Loss-spike rule: a step whose loss exceeds spike_factor x the median of the last spike_window steps' losses
    is a spike (null: no rule). A spike's update is not applied; the run rolls back to its last checkpoint and
    replays the same batches bitwise. Reproduced (the data did it): that step's batch is skipped, recorded in the
    run's history (checkpoint.dir/spikes.json) and in every later checkpoint, so any resume skips it too.
    Not reproduced (a transient fault): recorded, with the rank and host whose loss changed most, and training goes
    on from the replayed step. Needs checkpoint.save_interval."""
    spike_window: int = 20
    """Loss-spike rule: the number of preceding steps whose median the loss is compared with (at most
    checkpoint.save_interval; the rule waits until the window is full)."""
    spike_lr_factor: float = 1.0
    """Loss-spike rule: after a reproduced spike, multiply the learning rate by this for spike_lr_steps steps."""
    spike_lr_steps: int = 0
    """Loss-spike rule: how many steps after a reproduced spike run at spike_lr_factor x the learning rate."""
    straggler_interval: int = 0
    """Every n steps, gather each rank's step time and name the slowest rank when it is more than
    straggler_margin slower than the median (0 disables)."""
    straggler_margin: float = 0.2
    """Relative margin over the median step time above which a rank is reported as a straggler."""
    deterministic: bool = False
    """Bitwise-reproducible steps (Megatron-LM's --deterministic-mode): torch.use_deterministic_algorithms, Megatron-
    Core's deterministic code paths (TransformerConfig.deterministic_mode: MoE unpermute, embedding backward), and
    in env.sh NCCL_ALGO=Ring, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, CUBLAS_WORKSPACE_CONFIG=:4096:8 (unless
    cluster.env sets an accepted value). Refuses the fusions that are not deterministic (cross-entropy loss fusion,
    TP communication overlap). Costs roughly 5-15% of step time (Megatron-LM's measurements)."""


@dataclass
class DataConfig:
    """Training data: a blend of Megatron indexed datasets (.bin/.idx), or mock data."""

    kind: str = choice("indexed", DATA_KINDS)
    """indexed (Megatron .bin/.idx prefixes) or mock (synthetic tokens, for debugging only)."""
    blend: List[Any] = field(default_factory=list)
    """Dataset prefixes, optionally weighted: [0.3, path/a, 0.7, path/b] or [path/a, path/b]. A relative prefix is
    relative to the directory python -m launcher runs in; the bundle's config.yaml holds every path of the job
    absolute, so the ranks never resolve one against their own working directory (launcher/core/paths.py; with
    cluster.container_image relative paths are refused)."""
    split: str = "969,30,1"
    """Train/valid/test split of each dataset, as relative weights."""
    tokenizer: Optional[str] = None
    """Path to a Hugging Face tokenizer.json (nothing is downloaded); relative: see blend."""
    cache_dir: Optional[str] = None
    """Where dataset index caches go; null means inside the run bundle (node-local safe); relative: see blend."""
    num_workers: int = 1
    """DataLoader worker processes per rank for training batches (0: assemble them in the rank itself)."""


@dataclass
class CheckpointConfig:
    """Distributed checkpointing (megatron.core.dist_checkpointing)."""

    dir: Optional[str] = None
    """Checkpoint directory; null means <bundle>/checkpoints. A run resumes from its latest checkpoint. A relative
    path is relative to the directory python -m launcher runs in (data.blend says more)."""
    save_interval: int = 0
    """Save every n steps (0: only at the end)."""
    save_at_end: bool = True
    """Save when training finishes or is stopped."""
    resume: bool = True
    """Resume automatically from the latest complete checkpoint in dir."""
    keep_last: Optional[int] = None
    """Keep only the newest n checkpoints; null keeps all."""
    format: str = choice("torch_dist", CHECKPOINT_FORMATS)
    """dist_checkpointing backend format. Under parallel.megatron_fsdp the ranks write Megatron-FSDP's own
    fsdp_dtensor format instead (DCP DTensors; the only one Megatron-FSDP writes, as in Megatron-LM)."""
    load: Optional[str] = None
    """Start from this checkpoint (an iter_* directory, or a checkpoint dir whose newest complete checkpoint
    is used) even if it belongs to another run or layout (fine-tune, changed TP/PP/DP); this run's own
    checkpoints in dir, once it has some, take precedence. Relative: as checkpoint.dir."""
    load_hf: Optional[str] = None
    """Start from Hugging Face weights (a directory with config.json and safetensors): render/submit/run first
    compare its config.json with the model entry (one error per differing field) and import it once with
    ``import-hf`` into output_dir/hf-imports/ (one process on this node, the whole model in memory once; reused
    while the weights and the model are the same), then load that as checkpoint.load at any layout. Relative: as
    checkpoint.dir."""
    verify: str = choice("sizes", CHECKPOINT_VERIFY)
    """Check a checkpoint before loading it: sizes (every file has the size recorded at save) or checksum
    (also its CRC32, spread over the ranks)."""
    optimizer_format: str = choice("dp_reshardable", OPTIMIZER_FORMATS)
    """Distributed-optimizer state on disk: dp_reshardable (each DP rank's shard; resume needs the same DP size)
    or fully_reshardable (gathered on DP rank 0; resumes at any DP size, about 10x the save time on CPU)."""
    async_save: bool = False
    """Write torch_dist checkpoints in the background while training goes on (Megatron-Core's async save: each
    rank's shards are staged in host memory, a writer process writes them, the checkpoint is published, manifest
    last, once every rank's writer finished). At most one save in flight; a stop or the end of training waits for
    it. Not with parallel.megatron_fsdp (fsdp_dtensor is written synchronously)."""


@dataclass
class LoggingConfig:
    """Metrics and logs."""

    log_interval: int = 1
    """Print metrics every n steps."""
    tensorboard: bool = True
    """Write TensorBoard event files into the bundle."""
    wandb_project: Optional[str] = None
    """Weights & Biases project; null disables wandb. The API key comes from WANDB_API_KEY only."""
    wandb_entity: Optional[str] = None
    """Weights & Biases entity (team)."""
    wandb_mode: str = choice("offline", WANDB_MODES)
    """wandb mode: offline, online or disabled."""


@dataclass
class ClusterConfig:
    """Where the job runs: hardware facts and site settings (a cluster profile)."""

    name: str = "local"
    """Profile name."""
    launcher: str = choice("local", LAUNCHERS)
    """slurm (sbatch + srun + torchrun per node) or local (torchrun on this machine)."""
    gpu: str = choice("cpu", GPUS)
    """Accelerator: H100, H200, B200, or cpu."""
    gpus_per_node: int = 4
    """GPUs (or CPU processes for the cpu profile) per node."""
    gpu_memory_gb: float = 24.0
    """Usable memory per GPU in GB (10^9 bytes)."""
    peak_tflops_bf16: float = 1.0
    """Dense BF16 peak per GPU in TFLOP/s (MFU denominator)."""
    peak_tflops_fp8: float = 2.0
    """Dense FP8 peak per GPU in TFLOP/s."""
    hbm_bandwidth_gbps: float = 100.0
    """Memory bandwidth per GPU in GB/s."""
    nvlink_bandwidth_gbps: float = 10.0
    """Intra-node bandwidth per GPU per direction in GB/s (NVLink)."""
    network_bandwidth_gbps: float = 1.0
    """Inter-node bandwidth per GPU per direction in GB/s (InfiniBand / RoCE)."""
    host_memory_gb: Optional[float] = None
    """Host memory per node in GB that activation offloading may pin (planner constant; null: not checked). The
    search keeps an offloading candidate only if its ranks' pinned buffers fit in it."""
    host_bandwidth_gbps: float = 10.0
    """GPU-host bandwidth per GPU per direction in GB/s with every GPU of the node copying (PCIe; planner constant
    for activation offloading's copies)."""
    checkpoint_write_gbps: float = 1.0
    """Checkpoint write bandwidth per node to checkpoint.dir in GB/s (the planner's save-time estimate, from
    which a null slurm.signal_lead_s is derived)."""
    gemm_efficiency: float = 0.7
    """Fraction of peak that large GEMMs reach (planner constant; see launcher/plan notes)."""
    fp8_gemm_efficiency: float = 0.5
    """Fraction of the FP8 peak that FP8 layer GEMMs reach in training, Transformer Engine's scaling and
    amax bookkeeping included (planner constant, fitted once on Hopper; see launcher/plan/NOTES.md)."""
    comm_efficiency: float = 0.8
    """Fraction of the NVLink bandwidth collectives within a node reach (planner constant)."""
    network_efficiency: float = 0.94
    """Fraction of network_bandwidth_gbps that large inter-node transfers reach (planner constant): NCCL's
    maintainers quote 46-48 GB/s per 400 Gb/s NDR ConnectX-7 NIC (nccl-tests issues #290, #267), 47/50 = 0.94."""
    memory_reserve_gb: float = 4.0
    """Memory held back per GPU for the CUDA context, allocator fragmentation and NCCL."""
    op_overhead_us: float = 0.0
    """Fixed time per eager op of a layer pass that the device itself spends beyond the op's FLOPs and bytes
    (planner constant, added to each layer's forward and backward, not overlapped): a CPU rank's dispatch and
    small-kernel cost. 0 on GPUs, whose host issuing overlaps the kernels (the planner's host-time model).
    action=bench fits it on CPU (launcher/calibration.py)."""
    compute_units_per_node: Optional[float] = None
    """Compute units the ranks of a node share (planner constant): the step is at least the node's busy
    rank-seconds over them. null: one unit per rank (a GPU each). On CPU, ranks share the cores; action=bench
    fits the share its run measured (launcher/calibration.py)."""
    profile: Optional[str] = None
    """A calibrated cluster profile (a YAML file action=bench wrote, BUNDLE/report/calibrated-NAME.yaml): its fitted
    terms (the GEMM efficiency) replace this profile's for compose, plan and search; it must belong to this
    cluster (same name and GPU kind). null: the profile's own constants."""
    backend: str = choice("gloo", BACKENDS)
    """torch.distributed backend: nccl (GPU) or gloo (CPU)."""
    partition: Optional[str] = None
    """Slurm partition."""
    account: Optional[str] = None
    """Slurm account."""
    container_image: Optional[str] = None
    """pyxis/enroot container image; null runs on the host environment."""
    container_mounts: List[str] = field(default_factory=list)
    """Container mounts, src:dst. Every data and checkpoint path must be under a mount's dst."""
    workdir: Optional[str] = None
    """Directory the job starts in on the nodes; null means the launcher checkout."""
    python: str = "python"
    """Python interpreter on the nodes."""
    max_restarts: Optional[int] = None
    """torchrun --max-restarts: restart all ranks of a node this many times after a rank dies (each restart
    resumes from the newest complete checkpoint); null means 3 on Slurm, 0 locally."""
    health_check: Optional[bool] = None
    """Before training, probe all-reduce bandwidth inside each node and point-to-point bandwidth between nodes,
    naming any node far below the others; null means on for multi-node jobs."""
    env: Dict[str, str] = field(default_factory=dict)
    """Environment variables exported in the job (NCCL, CUDA_DEVICE_MAX_CONNECTIONS, ...)."""
    secret_env: List[str] = field(default_factory=lambda: ["WANDB_API_KEY", "HF_TOKEN"])
    """Variables passed through by name only; their values are never written into the bundle."""


@dataclass
class ProfileConfig:
    """What operators reach for when a run is slow or runs out of memory (Megatron-LM's --profile,
    --use-pytorch-profiler, --profile-step-start/-end, --profile-ranks, --record-memory-history). Everything lands
    in the run bundle's profile/ folder."""

    kind: str = choice(Profiler.NONE, PROFILERS)
    """nsys: the ranks in profile.ranks run under Nsight Systems (the bundle's rank.sh wraps them) and capture only
    steps step_start..step_end-1 (cudaProfilerStart/Stop, NVTX ranges); torch: torch.profiler writes a Chrome
    trace per profiled rank (profile/torch/rank<N>.*.pt.trace.json, TensorBoard's profiler plugin and Perfetto
    open it); none: no profiling."""
    step_start: int = 10
    """First profiled step (1-based, as the step lines count)."""
    step_end: int = 12
    """Profiling stops before this step (Megatron-LM's --profile-step-end)."""
    ranks: List[int] = field(default_factory=lambda: [0])
    """Global ranks that profile."""
    memory_snapshot: bool = False
    """Record the CUDA caching allocator's history on every rank (torch.cuda.memory._record_memory_history) and,
    when a rank runs out of memory, dump it into profile/memory-rank<N>.pickle (open it at pytorch.org/memory_viz).
    GPU only."""
    memory_snapshot_entries: int = 100000
    """Allocation events kept for the snapshot (the newest ones)."""


@dataclass
class SlurmConfig:
    """Slurm submission settings."""

    time: str = "04:00:00"
    """Wall-time limit (HH:MM:SS or D-HH:MM:SS)."""
    job_name: Optional[str] = None
    """Job name; null means the recipe name."""
    signal_lead_s: Optional[int] = None
    """Seconds before the time limit at which SIGUSR1 asks the job to checkpoint and exit. Null derives it at
    render time: signal_save_factor x the save time (the newest checkpoint's measured one in checkpoint.dir, else
    the planner's estimate from cluster.checkpoint_write_gbps) + a step + signal_margin_s, at least 300 s (a
    quarter of a shorter time limit). Either way the ranks also stop by themselves once the job's time left is below that,
    with their own measured save time (a requeue reruns the same --signal lead)."""
    signal_save_factor: float = 2.0
    """How many of the last measured save times to keep in hand before the time limit (>= 1)."""
    signal_margin_s: int = 60
    """Seconds kept in hand beyond the save and one step (teardown, the job script's requeue)."""
    requeue: bool = True
    """Requeue the job after preemption or a clean time-limit exit."""
    max_requeues: int = 3
    """Requeue at most this many times (a run that ends without DONE and did not fail is requeued)."""
    on_hang: str = choice("stop", ("stop", "exclude"))
    """When the hang watchdog (timeouts.hang_s) names the rank that hangs the others: stop (the job fails with that
    line), or exclude: submit the bundle again as a new job with the culprit's node left out (sbatch --exclude, the
    nodes left out before kept), at most max_requeues times; it resumes from the last checkpoint. Each resubmission
    is recorded in BUNDLE/hangs.jsonl and submission.json follows the new job."""
    exclusive: bool = True
    """Request whole nodes."""
    extra_args: List[str] = field(default_factory=list)
    """Extra #SBATCH lines, e.g. ["--qos=high"]."""


@dataclass
class TimeoutsConfig:
    """How long a healthy job may wait in one collective before it counts as hung. Null derives each at render time
    from the planned step and save times (launcher/core/timeouts.py: at least Megatron-LM's 10 minutes; longer for
    long steps and slow saves); ``action=plan`` prints them, the bundle's meta.json records them."""

    collective_s: Optional[int] = None
    """The process-group timeout of every collective and p2p op (``init_process_group(timeout=)``; NCCL's
    watchdog aborts a rank waiting longer). Must be longer than a planned step."""
    hang_s: Optional[int] = None
    """The per-node hang watchdog: once a step has completed, no collective progress for this long is a hang (every
    rank's stacks dumped into BUNDLE/hang-STEP/, the rank that never entered the collective named, the run
    stopped). Shorter than collective_s; null: 5 planned steps or a save, at least 120 s."""
    heartbeat_s: Optional[int] = None
    """NCCL's heartbeat-monitor timeout (``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``, GPU clusters): longer than the
    collective timeout, so a timed-out rank dumps its Flight Recorder trace before it is killed."""


@dataclass
class PostConfig:
    """Steps run after training ends with DONE, for every kept checkpoint (launcher/hf/post.py): export to Hugging
    Face and evaluate. Slurm: the training job submits them as one job (``afterok`` on itself) at its successful end;
    a local run runs them after training. Results go beside each checkpoint; ``runs`` and ``status`` show them."""

    export_hf: bool = False
    """Export every kept checkpoint to <checkpoint>/hf (export-hf: safetensors, config.json, tokenizer)."""
    eval: bool = False
    """Evaluate every kept checkpoint: perplexity on post.eval_blend, written atomically to <checkpoint>/eval.json
    (iteration, tokens, loss, perplexity, blend). Uses the exported model (a temporary export when export_hf=false)."""
    eval_blend: List[Any] = field(default_factory=list)
    """Held-out dataset prefixes ([prefix, ...] or [weight, prefix, ...]), read whole; empty: the validation split
    (data.split) of data.blend. Relative: as data.blend."""
    eval_samples: int = 16
    """Sequences of model.seq_length tokens evaluated per checkpoint (fewer if the held-out data is shorter)."""
    lm_eval_tasks: List[str] = field(default_factory=list)
    """lm-eval-harness tasks run on each export (e.g. ["hellaswag"]) where lm_eval is installed; without it, said
    once and skipped. Results: <checkpoint>/lm_eval.json."""


@dataclass
class JobConfig:
    """A whole job: what to train, how to lay it out, and where to run it."""

    name: str = "smoke"
    """Run name (used for the bundle directory and the Slurm job name)."""
    action: str = choice("default", ACTIONS)
    """render, submit, run, plan, search, validate, megatron-args (print the job as Megatron-LM pretrain_gpt.py
    arguments), list (the recipe catalogue with its H100/H200 layouts, planned), bench (a few steps of this job's
    layout on this machine, measured against the plan, written as a calibrated cluster profile that
    cluster.profile selects), or default (render; and run when cluster is local)."""
    nodes: int = 1
    """Number of nodes (top-level shorthand)."""
    output_dir: str = "runs"
    """Where run bundles are created, one new directory per run. A relative path is relative to the directory
    python -m launcher runs in (data.blend says more)."""
    force: bool = False
    """Render/submit even if the planner predicts out-of-memory."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    post: PostConfig = field(default_factory=PostConfig)


SECTIONS = {
    "model": ModelConfig, "parallel": ParallelConfig, "schedule": ScheduleConfig,
    "precision": PrecisionConfig, "train": TrainConfig, "data": DataConfig,
    "checkpoint": CheckpointConfig, "logging": LoggingConfig, "cluster": ClusterConfig,
    "slurm": SlurmConfig, "profile": ProfileConfig, "timeouts": TimeoutsConfig,
    "post": PostConfig,
}


@functools.cache
def register() -> None:
    """Register the schema in Hydra's ConfigStore (a process-wide singleton), once per process: storing converts
    the whole dataclass tree, ~12 ms a time. Hydra is imported here, not at the top: the rank wing reads these
    dataclasses from every rank's config.yaml and never composes (importing Hydra cost each rank ~0.5 CPU s)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="job_schema", node=JobConfig)
