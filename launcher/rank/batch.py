"""Context parallelism applied to a micro-batch, and the masked token loss that stays right under CP.

Megatron-Core does not slice the batch for you under context parallelism: each CP rank must keep its own
load-balanced share of the sequence (``megatron.core.utils.get_batch_on_this_cp_rank``), and the loss
function must average over the tokens of the *whole* sequence, which no single CP rank holds.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch


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
