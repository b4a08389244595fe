"""Megatron-Core DDP wrapping, optimizer (optionally distributed) and LR schedule."""
from __future__ import annotations

from typing import List

import torch

from launcher.schema import ParallelConfig, PrecisionConfig, TrainConfig

LR_STYLES = {"cosine": "cosine", "linear": "linear", "constant": "constant", "wsd": "WSD"}


def wrap_ddp(chunks: List[torch.nn.Module], *, parallel: ParallelConfig) -> List[torch.nn.Module]:
    """Megatron-Core DistributedDataParallel around each chunk (contiguous grad buffers, DP reduce)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.utils import get_model_config

    on_gpu = torch.cuda.is_available()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=parallel.distributed_optimizer,
        # overlapping needs CUDA streams; on CPU the reduce runs after backward
        overlap_grad_reduce=parallel.overlap_grad_reduce and on_gpu,
        overlap_param_gather=parallel.overlap_param_gather and on_gpu and parallel.distributed_optimizer,
        check_for_nan_in_grad=False, bucket_size=None if not on_gpu else 40_000_000)
    config = get_model_config(chunks[0])
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                    disable_bucketing=i > 0)  # only the first chunk overlaps (Megatron)
            for i, chunk in enumerate(chunks)]


def build_optimizer(model: List[torch.nn.Module], *, train: TrainConfig, parallel: ParallelConfig,
                    precision: PrecisionConfig):
    """Adam(W) via megatron.core.optimizer; grad clipping is part of its step()."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from models.builder import DTYPES

    dtype = DTYPES[precision.dtype]
    config = OptimizerConfig(
        optimizer="adam", lr=train.lr, min_lr=train.min_lr, weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2, adam_eps=train.adam_eps,
        clip_grad=train.clip_grad, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        params_dtype=dtype, use_distributed_optimizer=parallel.distributed_optimizer)
    return get_megatron_optimizer(config, model)


def build_scheduler(optimizer, *, train: TrainConfig, steps: int):
    """megatron.core OptimizerParamScheduler: linear warmup, then cosine | linear | constant | WSD."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if train.lr_schedule not in LR_STYLES:
        raise ValueError(f"train.lr_schedule={train.lr_schedule!r}; use one of {sorted(LR_STYLES)}")
    style = LR_STYLES[train.lr_schedule]
    wsd = (train.wsd_decay_steps or max(1, steps // 10)) if style == "WSD" else None
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if train.warmup_steps else train.lr, max_lr=train.lr, min_lr=train.min_lr,
        lr_warmup_steps=train.warmup_steps, lr_decay_steps=max(steps, train.warmup_steps + 1),
        lr_decay_style=style, start_wd=train.weight_decay, end_wd=train.weight_decay,
        wd_incr_steps=max(steps, 1), wd_incr_style="constant", wsd_decay_steps=wsd,
        lr_wsd_decay_style="linear" if wsd else None)


def hook_model_config(model: List[torch.nn.Module], optimizer, *, parallel: ParallelConfig) -> None:
    """Tell the pipeline schedule how to finalize grads and scale the loss (Megatron's training.py)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    if parallel.overlap_grad_reduce and torch.cuda.is_available():
        config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
        config.grad_sync_func = ([m.start_grad_sync for m in model] if len(model) > 1
                                 else model[0].start_grad_sync)
