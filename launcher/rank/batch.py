"""A micro-batch on this rank: read on TP rank 0 and broadcast to the TP group, context parallelism applied, and
the masked token loss that stays right under CP.

Megatron-LM reads each micro-batch on tensor-parallel rank 0 only and broadcasts it to the other TP ranks
(``pretrain_gpt.py`` ``get_batch`` -> ``megatron.core.utils.get_batch_on_this_tp_rank``); the other TP ranks build
no data loader. Megatron-Core does not slice the batch for you under context parallelism: each CP rank must keep
its own load-balanced share of the sequence (``megatron.core.utils.get_batch_on_this_cp_rank``), and the loss
function must average over the tokens of the *whole* sequence, which no single CP rank holds.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
"""What a micro-batch holds ([micro_batch_size, seq_length] each; no attention mask: causal attention makes its own)."""


def chunk_role(model) -> Optional[Tuple[bool, bool, bool]]:
    """(holds the embedding, holds the output layer and loss, holds MTP layers) of a model chunk: GPTModel's
    ``pre_process`` / ``post_process`` / ``mtp_process`` under the DDP / Float16Module wrappers (Megatron-LM's
    ``get_batch`` asks the same by the chunk's virtual stage; under zb_v both ends are rank 0's chunks). None for
    a model without them (a test's stand-in)."""
    inner = model
    while not hasattr(inner, "pre_process") and hasattr(inner, "module"):
        inner = inner.module
    if not hasattr(inner, "pre_process"):
        return None
    return bool(inner.pre_process), bool(inner.post_process), bool(getattr(inner, "mtp_process", False))


def _model_parallel_ready() -> bool:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from megatron.core import parallel_state

    return parallel_state.model_parallel_is_initialized()


def batch_on_this_tp_rank(data_iterator, model, batch_shape: Optional[Tuple[int, int]] = None) -> Dict:
    """This chunk's micro-batch ({BATCH_KEYS}, on the compute device, before CP slicing), as Megatron-LM's
    ``pretrain_gpt.py`` ``get_batch`` gets it: a chunk that is neither the first nor the last pipeline stage and
    holds no MTP layers reads nothing (all None); otherwise TP rank 0 reads the next micro-batch from
    ``data_iterator`` and Megatron-Core's ``get_batch_on_this_tp_rank`` broadcasts over the TP group what the
    stage needs (first stage: tokens, position ids; last stage: labels, loss mask; MTP or PP = 1: all four; the
    others None). TP ranks other than 0 never touch ``data_iterator`` (None on them, as in Megatron-LM, whose
    other TP ranks build no loader) and receive into buffers of ``batch_shape`` = (micro_batch_size,
    seq_length), required there. Every tensor reaching the broadcast is on ``compute_device()`` (NCCL takes
    device tensors only); the receive buffers are Megatron's own (``torch.cuda.current_device()``).

    A model without ``pre_process`` (a test's stand-in) counts as the whole pipeline when it is given an iterator
    and as a middle stage when it is not. Without Megatron parallel state the batch is returned as read."""
    role = chunk_role(model)
    first, last, mtp = role if role is not None else (data_iterator is not None, data_iterator is not None, False)
    if not (first or last or mtp):
        return dict.fromkeys(BATCH_KEYS)
    ready = _model_parallel_ready()
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank() if ready else 0
    batch: Dict = {}
    if tp_rank == 0:
        if data_iterator is None:
            raise RuntimeError("a chunk holding the embedding, the output layer or MTP layers was given no data "
                               "iterator on tensor-parallel rank 0 (launcher.rank.data.chunks_reading_data)")
        from models.backend import compute_device

        dev = compute_device()
        read = next(data_iterator)
        batch = {k: read[k].to(dev, non_blocking=True) if read.get(k) is not None else None for k in BATCH_KEYS}
    if not ready:
        return batch
    if tp_rank != 0 and batch_shape is None:
        raise RuntimeError("tensor-parallel rank > 0 receives the micro-batch by broadcast and needs its shape: "
                           "call forward_step with batch_shape=(micro_batch_size, seq_length) "
                           "(launcher.rank.loop.forward_step_for)")
    from megatron.core.utils import get_batch_on_this_tp_rank

    micro_batch_size, seq_length = batch_shape if batch_shape is not None else (0, 0)  # read on TP rank 0 only
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False, create_attention_mask_in_dataloader=False,
        broadcast_src_rank=ps.get_tensor_model_parallel_src_rank(),
        broadcast_group=ps.get_tensor_model_parallel_group(),
        cp_size=ps.get_context_parallel_world_size(), tp_rank=tp_rank, micro_batch_size=micro_batch_size,
        seq_length=seq_length, mtp_on_this_rank=mtp,
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        # the chunk's stage, where Megatron-LM passes the rank's (mpu.is_pipeline_first_stage()): the same for
        # every chunk that reads, except zb_v's rank 0, which holds the first stage and the last
        is_pipeline_first_stage=first, is_pipeline_last_stage=last)
    return {k: batch.get(k) for k in BATCH_KEYS}


def _cp_group_and_size():
    """(CP process group, CP size); (None, 1) when there is no Megatron parallel state to ask."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None, 1
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None, 1
    group = parallel_state.get_context_parallel_group()
    return group, torch.distributed.get_world_size(group)


def slice_batch_for_context_parallel(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """This CP rank's part of ``batch`` ({tokens, labels, loss_mask, position_ids}, each [b, s]).

    Megatron-Core's own ``get_batch_on_this_cp_rank`` (0.19.2) does the slicing: the sequence is cut into
    2*CP chunks and CP rank r keeps chunks r and 2*CP-1-r, concatenated in that order (load balance for
    causal attention). Returns ``batch`` itself when CP size is 1. The input dict is not modified (Megatron
    reassigns the keys of the dict it is given, so it gets a shallow copy).

    Notes on the 0.19.2 helper, checked against its source:
    - it must be given the CP group explicitly: with ``cp_group=None`` it would take the size and rank of
      the *default* (world) group;
    - without a ``cu_seqlens`` key (or with ``cu_seqlens=None``) it takes the per-sequence zigzag path we
      want; ``is_hybrid_cp=False``;
    - an ``attention_mask`` entry, if present, is sliced on dim 2 ([b, 1, s_q, s_k] -> queries only);
      None-valued entries (intermediate pipeline stages) are passed through;
    - it needs no CUDA: its index tensor is built on ``val.device``, so no CPU bridge is applied here.
    """
    group, cp_size = _cp_group_and_size()
    if cp_size == 1:
        return batch
    for key, val in batch.items():
        if key in ("tokens", "labels", "loss_mask", "position_ids") and val is not None \
                and val.shape[1] % (2 * cp_size):
            raise ValueError(f"context parallelism {cp_size} needs the sequence length to be a multiple of "
                             f"2 x CP = {2 * cp_size}; batch[{key!r}] has shape {tuple(val.shape)}")
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=group)


def masked_token_loss(loss_mask: torch.Tensor,
                      output: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Megatron loss_func: mean of the per-token losses ``output`` ([b, s_local]) over the unmasked tokens
    of the whole sequence, across the CP group. Returns (loss for the schedule, {"lm loss": reported}).

    Gradient convention mirrored: Megatron-LM ``pretrain_gpt.py`` ``loss_func`` in its 2-value form (before
    it returned ``(sum, num_tokens, report)``): ``loss = cat([sum(losses * loss_mask), loss_mask.sum()])``,
    in-place ``all_reduce`` over ``mpu.get_context_parallel_group()`` (not autograd-tracked, so the gradient
    is this rank's), ``loss = loss[0] / loss[1]``, ``return loss * args.context_parallel_size, ...``. DDP averages gradients over the DP x CP group
    (``gradient_scaling_factor = 1 / dp_cp_group.size()``), while each CP rank holds only part of the
    sequence, so the loss each CP rank back-propagates must be ``cp_size * local_sum / global_count`` with
    the global token count all-reduced over CP and detached. Summed over the CP ranks and divided by CP
    (DDP's average) that gives exactly the gradient of the full-sequence masked mean.

    Where the cp_size factor is applied: Megatron-Core 0.19.2's schedule applies it itself to a 2-value
    loss_func result (``forward_step_calc_loss``: ``output_tensor *= cp_group_size`` then
    ``/= num_microbatches``, the "legacy loss averaging" path), so this function returns
    ``local_sum / global_count`` and the schedule turns it into ``cp_size * local_sum / global_count``.
    Multiplying here as well would scale the gradients by CP twice.

    The reported value is the true global mean ``sum_over_cp(local_sum) / global_count`` (the same on every
    CP rank), detached and cloned: the schedule scales the returned loss in place.

    With CP = 1 this is exactly the former ``sum(output * mask) / mask.sum().clamp(min=1)``, with no
    collective call.
    """
    mask = loss_mask.view(-1).float()
    local_sum = torch.sum(output.view(-1).float() * mask)
    group, cp_size = _cp_group_and_size()
    if cp_size == 1:
        loss = local_sum / mask.sum().clamp(min=1)
        return loss, {"lm loss": loss.detach().clone()}
    # One collective: [sum of masked losses, unmasked token count] over the CP group; both detached, so the
    # gradient of ``loss`` flows through this rank's ``local_sum`` only.
    totals = torch.stack([local_sum.detach(), mask.sum()])
    torch.distributed.all_reduce(totals, group=group)
    global_count = totals[1].clamp(min=1)
    loss = local_sum / global_count  # the schedule multiplies by cp_size (see above)
    return loss, {"lm loss": (totals[0] / global_count).clone()}
