"""The GPU lane's jobs (tests/gpu/): override lists for a first node, torch-free so that a CPU test
(tests/test_gpu_lane_jobs.py) composes, validates and renders every one of them on the login node: the lane
cannot rot unseen between the rare runs on a GPU.

Sizes: a small Llama (4 layers at hidden 1024, GQA, SwiGLU, RoPE) that trains in seconds on an H100/H200 yet has
GEMMs large enough for FP8 to be exercised (every dimension a multiple of 16, as TE's FP8 GEMMs need); the MFU
job is the Llama3-8B layer width (hidden 4096, FFN 14336) so that the planner's prediction is meaningful.
"""
from __future__ import annotations

from typing import List

SMALL_LLAMA = ["recipe=smoke", "data=mock", "model.num_layers=4", "model.hidden_size=1024",
               "model.ffn_hidden_size=3584", "model.num_attention_heads=16", "model.num_query_groups=4",
               "model.seq_length=1024", "model.vocab_size=32000", "model.make_vocab_size_divisible_by=128",
               "train.micro_batch_size=2", "train.lr=3e-4", "train.min_lr=3e-5", "train.warmup_steps=2",
               "train.eval_interval=0", "logging.tensorboard=false", "checkpoint.save_at_end=false"]
"""The small Llama on mock data (token ids drawn per sample: no tokenizer or corpus needed on the node)."""

GPU = ["cluster=h100", "cluster.launcher=local", "nodes=1", "precision.dtype=bf16",
       "precision.transformer_engine=true"]
"""A GPU node of the h100 profile (same NCCL/env rules on H200), run by torchrun on this node; TE required."""


def gpus(n: int) -> List[str]:
    return [f"cluster.gpus_per_node={n}"]


def parallel(tp: int = 1, pp: int = 1, vpp: int = 0, ep: int = 1) -> List[str]:
    out = [f"parallel.tensor={tp}", f"parallel.pipeline={pp}", f"parallel.expert={ep}",
           f"parallel.sequence_parallel={'true' if tp > 1 else 'false'}", "parallel.context=1"]
    if vpp:
        out.append(f"parallel.virtual_pipeline={vpp}")
    return out


def fp8_llama(n: int, steps: int = 20) -> List[str]:
    """TE layers + FP8 (tensorwise scaling) on every GPU of the node: TP over up to 2 GPUs, the rest DP."""
    tp = 2 if n >= 2 else 1
    return [*SMALL_LLAMA, *GPU, *gpus(n), *parallel(tp=tp), "precision.fp8=tensorwise",
            f"train.global_batch_size={2 * n // tp * 4}", f"train.train_steps={steps}"]


ZB_TP_KINDS = ("1f1b", "interleaved", "zb_h1", "zb_h1_vpp", "zb_v")
"""The pipeline schedules the lane runs with TP, FP8 and userbuffer overlap (zb_h1_vpp: ZB-H1 over VPP 2)."""


def zero_bubble_tp(kind: str, n: int = 8, steps: int = 8) -> List[str]:
    """TP2 x PP n/2 (2..4) on n GPUs, FP8 (tensorwise) and the userbuffer TP overlap (the sub-overlaps zero bubble
    keeps, models/deferred_wgrad.py ZB_TP_OVERLAP): TP > 1 derives CUDA_DEVICE_MAX_CONNECTIONS=1, the one hardware
    queue per GPU under which a p2p program that needs independent queues hangs (launcher/core/pipeline/p2p.py). 1F1B (the
    reference), interleaved, ZB-H1, ZB-H1 over VPP 2 and ZB-V over the same model, data and 8 microbatches."""
    pp = max(2, min(4, n // 2))
    vpp = 2 if kind in ("interleaved", "zb_h1_vpp", "zb_v") else 0
    return [*SMALL_LLAMA, *GPU, *gpus(2 * pp), *parallel(tp=2, pp=pp, vpp=vpp), "model.num_layers=8",
            "precision.fp8=tensorwise", "parallel.tp_comm_overlap=true",
            f"schedule.kind={'zb_h1' if kind == 'zb_h1_vpp' else kind}", "train.global_batch_size=16",
            f"schedule.overlap_p2p_comm={'true' if vpp else 'false'}", f"train.train_steps={steps}"]


def fsdp(on: bool, n: int = 2, steps: int = 8) -> List[str]:
    """Megatron-FSDP (ZeRO-3, optim_grads_params) over n GPUs against DDP with the distributed optimizer: FSDP
    needs CUDA_DEVICE_MAX_CONNECTIONS unset (Megatron-LM refuses 1), which env.sh does inside the image too."""
    return [*SMALL_LLAMA, *GPU, *gpus(n), *parallel(), "parallel.distributed_optimizer=true",
            f"parallel.megatron_fsdp={'true' if on else 'false'}", f"train.global_batch_size={4 * n}",
            f"train.train_steps={steps}"]


def moe(overlap: bool, steps: int = 10) -> List[str]:
    """A small MoE (8 experts, top-2) with EP2 on 2 GPUs; with or without the all-to-all overlap, which runs
    Megatron-Core's combined 1F1B schedule."""
    return [*SMALL_LLAMA, *GPU, *gpus(2), *parallel(ep=2), "model.num_experts=8", "model.moe_router_topk=2",
            "model.moe_ffn_hidden_size=1024", "model.moe_token_dispatcher_type=alltoall",
            f"parallel.moe_a2a_overlap={'true' if overlap else 'false'}", "train.global_batch_size=8",
            f"train.train_steps={steps}"]


LEVERS = {
    "plain": [],
    # TE's per-layer CUDA graphs over attention and the MLP, captured after 2 eager steps
    "cuda_graphs": ["train.cuda_graph_impl=transformer_engine", "train.cuda_graph_modules=[attn,mlp]",
                    "train.cuda_graph_warmup_steps=2"],
    # TE's FusedAdam with bf16 moments and bf16 main gradients
    "precision_aware": ["parallel.distributed_optimizer=true", "precision.grad_reduce_in_fp32=false",
                        "precision.precision_aware_optimizer=true", "precision.main_grads_dtype=bf16",
                        "precision.exp_avg_dtype=bf16", "precision.exp_avg_sq_dtype=bf16"],
    # half of the Adam state and its step on the host (HybridDeviceOptimizer)
    "optimizer_offload": ["parallel.distributed_optimizer=true", "precision.precision_aware_optimizer=true",
                          "train.optimizer_cpu_offload=true",
                          "train.optimizer_offload_fraction=0.5", "train.overlap_cpu_optimizer_d2h_h2d=true"],
    # fine-grained activation offloading of the attention inputs (NVTE_CPU_OFFLOAD_V1=1 comes from env.sh)
    "activation_offload": ["train.activation_offload_modules=[qkv_linear,core_attn,attn_proj]",
                           "train.min_offloaded_tensor_size=65536"],
}
"""Issue 41's speed levers, each alone on the same model, data and steps as ``plain``."""


def lever(name: str, steps: int = 8) -> List[str]:
    """The small Llama on one GPU in BF16 without recompute (activation offloading refuses recomputed attention),
    with one of ``LEVERS``."""
    return [*SMALL_LLAMA, *GPU, *gpus(1), *parallel(), "train.recompute=none", "train.global_batch_size=8",
            f"train.train_steps={steps}", *LEVERS[name]]


def checkpointed(n: int, steps: int = 6, every: int = 3) -> List[str]:
    return [*fp8_llama(n, steps), f"checkpoint.save_interval={every}"]


def mfu(n: int = 1, steps: int = 12) -> List[str]:
    """Llama3-8B layer width, 4 layers, seq 4096, BF16 on one GPU (no FP8: the planner's BF16 peak applies)."""
    return [*SMALL_LLAMA, *GPU, *gpus(n), *parallel(), "model.hidden_size=4096", "model.ffn_hidden_size=14336",
            "model.num_attention_heads=32", "model.num_query_groups=8", "model.seq_length=4096",
            "model.vocab_size=128256", "train.micro_batch_size=1", f"train.global_batch_size={4 * n}",
            f"train.train_steps={steps}"]


def hang(n: int = 4) -> List[str]:
    """TP2 x PP2 on 4 GPUs (PP2 on 2): runs until a rank is stopped; the agent's watchdog must then name it from the
    NCCL Flight Recorder traces of the others (issue 39's GPU path: TORCH_FR_* / TORCH_NCCL_* rendered into env.sh,
    the traces dumped on the watchdog's signal, analysed by launcher/rank/flight_recorder.py)."""
    return [*SMALL_LLAMA, *GPU, *gpus(n), *parallel(tp=2 if n >= 4 else 1, pp=2), "train.global_batch_size=8",
            "train.train_steps=100000", "checkpoint.save_interval=0", "timeouts.hang_s=30"]


def bench(n: int = 8) -> List[str]:
    """The catalogue's Llama3-8B recipe (TP1 x CP2 x DP4, FP8) as it runs on one node, for action=bench: the run
    that measures the node and writes its calibrated profile. Its own layout and model; a smaller global batch (16:
    4 microbatches per DP rank) keeps the bench's 8 steps short."""
    return ["recipe=llama3_8b", "cluster.launcher=local", "nodes=1", *gpus(n), "train.global_batch_size=16"]


ALL = {"hang_4": hang(4), "bench_llama3_8b": bench(8), "hang_2": hang(2), "fp8_llama_1": fp8_llama(1), "fp8_llama_8": fp8_llama(8), "moe_ep2": moe(False),
       "moe_ep2_a2a_overlap": moe(True), "checkpointed_1": checkpointed(1), "mfu_1": mfu(1),
       "fsdp_2": fsdp(True), "ddp_2": fsdp(False), **{f"lever_{name}": lever(name) for name in LEVERS},
       **{f"tp2_{kind}_{n}gpu": zero_bubble_tp(kind, n) for kind in ZB_TP_KINDS for n in (4, 8)}}
"""Every job of the lane (the CPU test renders each)."""
