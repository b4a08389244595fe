"""Megatron-Core DDP wrapping, optimizer (optionally distributed) and LR schedule.

The config objects are built by their own functions (``ddp_config``, ``optimizer_config``,
``scheduler_kwargs``) so the wiring test can build exactly what a GPU rank builds, on CPU.
"""
from __future__ import annotations

from typing import List

import torch

from launcher.schema import LR_SCHEDULES, ParallelConfig, PrecisionConfig, TrainConfig

OPTIMIZER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}
"""schema.OPTIMIZER_*_DTYPES -> torch dtypes, as Megatron-LM's arguments.py dtype_map (fp8 is stored as uint8)."""

LR_STYLES = {"cosine": "cosine", "linear": "linear", "constant": "constant", "wsd": "WSD"}
"""schema.LR_SCHEDULES -> OptimizerParamScheduler's lr_decay_style."""
assert set(LR_STYLES) == set(LR_SCHEDULES)


def ddp_config(*, parallel: ParallelConfig, precision: PrecisionConfig, on_gpu: bool):
    """Megatron-Core's DistributedDataParallelConfig for this job."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=precision.grad_reduce_in_fp32,
        use_distributed_optimizer=parallel.distributed_optimizer,
        # overlapping needs CUDA streams; on CPU the reduce runs after backward. Megatron-FSDP keeps the GPU's
        # setting on CPU, so the CPU run is the GPU's code path (gloo's async work stands in for the streams: each
        # layer's reduce-scatter starts in its backward, its all-gather in its forward; same losses either way)
        overlap_grad_reduce=parallel.overlap_grad_reduce and (on_gpu or parallel.megatron_fsdp),
        overlap_param_gather=_overlap_param_gather(parallel, on_gpu),
        # FP8 primary weights are re-quantised by the distributed optimizer only under fp8_param_gather
        # (optimizer/distrib_optimizer.py); Megatron-LM sets the two together (training/argument_utils.py).
        fp8_param_gather=precision.fp8_param,
        # with virtual pipelines the interleaved schedule dispatches each chunk's parameter all-gather itself
        # (config.param_sync_func, hook_model_config): Megatron-LM's --align-param-gather is on by default and
        # forced off without VPP (megatron/training/arguments.py validate_args, "Setting args.overlap_p2p_comm
        # and args.align_param_gather to False"); training.py get_megatron_ddp_config copies it into DDP's config
        align_param_gather=(parallel.virtual_pipeline or 1) > 1,
        # Megatron-FSDP: parameters, gradients and optimizer state sharded over DP (ZeRO-3)
        use_megatron_fsdp=parallel.megatron_fsdp,
        data_parallel_sharding_strategy="optim_grads_params" if parallel.megatron_fsdp else "no_shard",
        # Megatron-FSDP divides gradients inside NCCL's PREMUL_SUM reduce-scatter when this is on
        # (megatron_fsdp/param_and_grad_buffer.py gradient_reduce_op); gloo has no PREMUL_SUM, so on CPU the
        # gradients are scaled first and summed (the same arithmetic as Megatron DDP's). Only FSDP reads it.
        gradient_reduce_div_fusion=on_gpu,
        # Megatron-FSDP does not read grad_reduce_in_fp32: its gradient buffer has the model's dtype unless
        # megatron_fsdp_main_grads_dtype says otherwise (Megatron-LM's --megatron-fsdp-main-grads-dtype, default
        # auto); its main (fp32) weights are megatron_fsdp_main_params_dtype's, fp32 by default
        megatron_fsdp_main_grads_dtype=torch.float32 if parallel.megatron_fsdp and precision.grad_reduce_in_fp32
        else None,
        # bucket_size stays None: DDP then applies Megatron-LM's default, max(40M, 1M x DP) elements, and
        # disables bucketing when the reduce is not overlapped (distributed_data_parallel.py)
        check_for_nan_in_grad=False)


def _overlap_param_gather(parallel: ParallelConfig, on_gpu: bool) -> bool:
    """DDP's and the optimizer's overlap_param_gather (the two must agree)."""
    if not on_gpu and not parallel.megatron_fsdp:
        return False  # Megatron DDP on CPU: the all-gather runs inside optimizer.step()
    return parallel.overlap_param_gather and parallel.distributed_optimizer


def wrap_ddp(chunks: List[torch.nn.Module], *, parallel: ParallelConfig,
             precision: PrecisionConfig) -> List[torch.nn.Module]:
    """Megatron-Core DistributedDataParallel around each chunk (contiguous grad buffers, DP reduce)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.utils import get_model_config

    from models.deferred_wgrad import mark_deferred_weights, te_modules

    config = ddp_config(parallel=parallel, precision=precision, on_gpu=torch.cuda.is_available())
    # zero bubble: weights with a deferred W get DDP's grad hook through their module (TE's backward_dw, or our
    # local W step), so the hook sees the gradient and a bucket's reduce starts after its last W
    local = sum([mark_deferred_weights(chunk) for chunk in chunks])
    config.delay_wgrad_compute = bool(local) or any(te_modules(chunk) for chunk in chunks)
    model_config = get_model_config(chunks[0])
    if parallel.megatron_fsdp:  # Megatron-FSDP's wrapper (on CPU through models/cpu_compat.py's FSDP bridges)
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        if not torch.cuda.is_available():
            from models import cpu_compat

            cpu_compat.apply_fsdp()
        wrapped = [FullyShardedDataParallel(config=model_config, ddp_config=config, module=chunk) for chunk in chunks]
        for chunk in wrapped:
            scale_unsharded_grads_once(chunk.module)
        return wrapped
    return [DistributedDataParallel(config=model_config, ddp_config=config, module=chunk,
                                    disable_bucketing=i > 0)  # only the first chunk overlaps (Megatron)
            for i, chunk in enumerate(chunks)]


def scale_unsharded_grads_once(fsdp) -> list:
    """Upstream bug (Megatron-FSDP in megatron-core 0.19.2, unchanged on Megatron-LM main of 2026-08): with sharding
    ``optim_grads_params`` gradients are reduced after every microbatch's backward, and a gradient buffer whose
    data-parallel group has one rank is not sharded (``is_data_distributed=... and group.size() > 1``,
    param_and_grad_buffer.py) but accumulates the microbatches in place; each reduction first scales the *whole*
    buffer by its factor (``gradient_reduce_preprocessing``: ``mul_``, or NCCL's PREMUL_SUM on a GPU). That is the
    expert buffer when EP takes all of DP (expert-DP 1, factor 1/DP): microbatch i of n ends up scaled (1/DP)^(n-i+1)
    instead of 1/DP. Measured on CPU (EP2 DP2, 2 microbatches): dense gradients equal Megatron DDP's, every expert's
    sum of squares 0.58-0.67x DDP's (0.25 g1 + 0.5 g2 instead of 0.5 (g1 + g2)); with 1 microbatch all equal.
    Here those buffers reduce unscaled and are scaled once, after the last reduction, before the optimizer reads
    them. Returns the (buffer, factor) pairs changed."""
    changed = []
    for group in fsdp.param_and_grad_buffer.parameter_groups:
        gbuf = group.main_grad_buffer
        if (gbuf is None or gbuf.is_data_distributed or getattr(group, "hfsdp_helper_gbuf", None) is not None
                or gbuf.gradient_scaling_factor in (None, 1.0)):
            continue
        changed.append((gbuf, gbuf.gradient_scaling_factor))
        gbuf.gradient_scaling_factor = None
    if changed:
        attach = fsdp.attach_grad_to_optimizer_state  # once per step, after all reductions (finish_grad_sync)

        def scale_then_attach():
            for gbuf, factor in changed:
                gbuf.data.mul_(factor)
            attach()
        fsdp.attach_grad_to_optimizer_state = scale_then_attach
    return changed


def optimizer_config(*, train: TrainConfig, parallel: ParallelConfig, precision: PrecisionConfig, on_gpu: bool):
    """Megatron-Core's OptimizerConfig: Adam(W); grad clipping is part of the optimizer's step()."""
    from megatron.core.optimizer import OptimizerConfig

    from models.builder import DTYPES

    dtype = DTYPES[precision.dtype]
    return OptimizerConfig(
        optimizer="adam", lr=train.lr, min_lr=train.min_lr, weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2, adam_eps=train.adam_eps,
        clip_grad=train.clip_grad, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        params_dtype=dtype, fp8_recipe=precision.fp8, use_distributed_optimizer=parallel.distributed_optimizer,
        overlap_param_gather=_overlap_param_gather(parallel, on_gpu),
        # the precision-aware optimizer's dtypes, as Megatron-LM maps its flags (arguments.py dtype_map:
        # fp8 -> torch.uint8); OptimizerConfig.__post_init__ asserts fp32 for each unless it is on
        use_precision_aware_optimizer=precision.precision_aware_optimizer,
        main_grads_dtype=OPTIMIZER_DTYPES[precision.main_grads_dtype],
        main_params_dtype=OPTIMIZER_DTYPES[precision.main_params_dtype],
        exp_avg_dtype=OPTIMIZER_DTYPES[precision.exp_avg_dtype],
        exp_avg_sq_dtype=OPTIMIZER_DTYPES[precision.exp_avg_sq_dtype],
        # HybridDeviceOptimizer: the offloaded share's Adam runs on the host (torch's AdamW, fp32)
        optimizer_cpu_offload=train.optimizer_cpu_offload,
        optimizer_offload_fraction=train.optimizer_offload_fraction,
        overlap_cpu_optimizer_d2h_h2d=train.overlap_cpu_optimizer_d2h_h2d,
        # pinned host buffers need an accelerator's allocator (CPU-only torch refuses pin_memory=True); on a GPU
        # Megatron's defaults (pinned) stand
        pin_cpu_grads=on_gpu, pin_cpu_params=on_gpu)


def build_optimizer(model: List[torch.nn.Module], *, train: TrainConfig, parallel: ParallelConfig,
                    precision: PrecisionConfig):
    """The (distributed) Megatron optimizer over the DDP-wrapped chunks."""
    from megatron.core.optimizer import get_megatron_optimizer

    config = optimizer_config(train=train, parallel=parallel, precision=precision, on_gpu=torch.cuda.is_available())
    return get_megatron_optimizer(config, model)


def host_offload(optimizer) -> tuple[int, int] | None:
    """(elements whose Adam state and step live on the host, elements of this rank's optimizer) under
    train.optimizer_cpu_offload, from the HybridDeviceOptimizer(s) Megatron-Core built; None without one."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    found = None
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(wrapper, "optimizer", None)
        if isinstance(inner, HybridDeviceOptimizer):
            host = sum(p.numel() for g in inner.cpu_param_groups for p in g["params"])
            total = sum(p.numel() for g in inner.param_groups for p in g["params"])
            found = (found[0] + host, found[1] + total) if found else (host, total)
    return found


def scheduler_kwargs(*, train: TrainConfig, steps: int) -> dict:
    """OptimizerParamScheduler's arguments: linear warmup, then cosine | linear | constant | WSD."""
    if train.lr_schedule not in LR_STYLES:  # validation refuses it first; a hand-built config lands here
        raise ValueError(f"train.lr_schedule={train.lr_schedule!r}; use one of {sorted(LR_STYLES)}")
    style = LR_STYLES[train.lr_schedule]
    wsd = (train.wsd_decay_steps or max(1, steps // 10)) if style == "WSD" else None
    return dict(
        init_lr=0.0 if train.warmup_steps else train.lr, max_lr=train.lr, min_lr=train.min_lr,
        lr_warmup_steps=train.warmup_steps, lr_decay_steps=max(steps, train.warmup_steps + 1),
        lr_decay_style=style, start_wd=train.weight_decay, end_wd=train.weight_decay,
        wd_incr_steps=max(steps, 1), wd_incr_style="constant", wsd_decay_steps=wsd,
        lr_wsd_decay_style="linear" if wsd else None)


def build_scheduler(optimizer, *, train: TrainConfig, steps: int):
    """megatron.core OptimizerParamScheduler over the optimizer."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(optimizer, **scheduler_kwargs(train=train, steps=steps))


def hook_model_config(model: List[torch.nn.Module], optimizer, *, parallel: ParallelConfig) -> None:
    """Tell the pipeline schedule how to finalize grads, scale the loss and (overlapped on GPU) when to start
    each chunk's gradient reduce and parameter all-gather, as Megatron-LM's training.py ``train`` does
    ("Setup some training config params": no_sync_func / grad_sync_func under overlap_grad_reduce with
    align_grad_reduce, its default; param_sync_func under overlap_param_gather with align_param_gather, i.e.
    with virtual pipelines; a single function instead of a list for one chunk)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    def per_chunk(name):
        return [getattr(m, name) for m in model] if len(model) > 1 else getattr(model[0], name)

    config = get_model_config(model[0])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    ddp = getattr(model[0], "ddp_config", None)
    if getattr(ddp, "overlap_grad_reduce", False):  # ddp_config turns it off without CUDA streams
        config.no_sync_func = per_chunk("no_sync")
        config.grad_sync_func = per_chunk("start_grad_sync")
    if getattr(ddp, "overlap_param_gather", False) and getattr(ddp, "align_param_gather", False):
        config.param_sync_func = per_chunk("start_param_sync")
