"""Megatron-FSDP's checkpoint format, ``fsdp_dtensor``: one torch.distributed.checkpoint (DCP) directory of DTensors.

Megatron-LM writes it with ``--use-megatron-fsdp --ckpt-format fsdp_dtensor`` (megatron/training/checkpointing.py:
``generate_state_dict`` takes ``model.state_dict_for_save_checkpoint()``, whose parameters are DTensors sharded over
DP, and ``optimizer.sharded_state_dict(..., metadata={'distrib_optim_sharding_type': 'fsdp_dtensor'})``, Adam's
moments per parameter name as DTensors of the parameter's shape; ``preprocess_fsdp_dtensor_state_dict`` then splits
gated fc1 weights into their two halves and records each uneven shard's offsets; ``torch.distributed.checkpoint.save``
writes it). Loading is the same state dict as a template that DCP fills in place, after which the model and the
optimizer load the un-split dicts (``_load_base_checkpoint``, ``ckpt_format == 'fsdp_dtensor'``). This module does
the same with Megatron-Core's own helpers (``megatron.core.transformer.fsdp_dtensor_checkpoint``,
``megatron_fsdp.uneven_dtensor``). Publishing, the manifest, the lock, fallback and pruning stay in
``launcher/rank/checkpoint/store.py``, as for torch_dist.

What DCP keeps per rank (the RNG streams) is stored under a key of its own per (PP, TP, DP) rank, so every rank
reads back exactly its own; everything else (step, consumed samples, LR schedule) is replicated and written once.
"""
from __future__ import annotations

from pathlib import Path
from typing import List

import torch

FORMAT = "fsdp_dtensor"


def _preprocess(state: dict, chunk, *, gated: bool, num_experts) -> dict:
    """Megatron-LM's ``preprocess_fsdp_dtensor_state_dict`` on what 0.19.2 ships: FP8 extra state, gated fc1
    split, experts, uneven-shard metadata. Returns a new top-level dict (the model/optimizer entries are new dicts
    of views of the same tensors, so DCP's in-place load fills the live ones)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor)
    from megatron.core.transformer.fsdp_dtensor_checkpoint import (
        handle_experts_in_state_dict, handle_fp8_extra_state_case, handle_swiglu_in_state_dict)

    out = dict(state)
    handle_fp8_extra_state_case(out["model"])
    if gated:  # model keys are 'module.X' (resolved from the wrapper), optimizer keys 'module.module.X' (resolved,
        # less their first 'module.', from the wrapped MegatronFSDP): one call each, with the module each resolves on
        out["model"], _ = handle_swiglu_in_state_dict(chunk, out["model"], None)
        if "optimizer" in out:
            _, out["optimizer"] = handle_swiglu_in_state_dict(chunk.module, {}, out["optimizer"])
    if num_experts:
        out["model"] = handle_experts_in_state_dict(out["model"], num_experts)
    preprocess_state_dict_for_uneven_dtensor(out)
    return out


def _rng_key() -> str:
    from megatron.core import parallel_state as ps

    return (f"rng_state/pp{ps.get_pipeline_model_parallel_rank()}_tp{ps.get_tensor_model_parallel_rank()}"
            f"_dp{ps.get_data_parallel_rank(with_context_parallel=True)}")


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"cpu": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _state_for_empty_shards(optimizer) -> None:
    """Adam state for the parameters whose shard on this rank is empty. torch's Adam creates state only for a
    parameter with a gradient, and Megatron-FSDP gives none to a rank that holds no element of it (a small
    parameter lies in one rank's part of the flat buffer); Megatron's dummy-state initialisation skips them too
    (distrib_optimizer.py ``_init_optimizer_states_with_dummy_values``). Then ranks hold different optimizer keys,
    and the per-key collectives of the fsdp_dtensor save (DTensor checks, the gated-fc1 split) wait for each other
    forever. Empty moments of the parameter's (empty) local shape and the common step make the keys agree; they
    carry no values, so training is unchanged."""
    inner = optimizer.optimizer
    template = next(iter(inner.state.values()), None)
    for group in inner.param_groups:
        for param in group["params"]:
            if param in inner.state:
                continue
            if template is None:  # no state on this rank at all yet (before the first step): Adam's fresh shape
                # torch.optim.Adam's own rule for "step" (adam.py _init_group: on the host unless capturable or
                # fused, "special device hosting for step")
                on_device = group.get("capturable") or group.get("fused")
                inner.state[param] = {"step": torch.tensor(0.0, device=param.device if on_device else "cpu"),
                                      "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
                continue
            inner.state[param] = {k: (torch.zeros_like(param) if torch.is_tensor(v) and v.dim() > 0 else
                                      v.clone() if torch.is_tensor(v) else v) for k, v in template.items()}


def state_dict(model: List[torch.nn.Module], optimizer, scheduler, *, step: int, consumed: int,
               is_loading: bool) -> dict:
    """The raw (un-preprocessed) state dict of this rank: what Megatron-LM's ``generate_state_dict`` builds."""
    if len(model) != 1:  # validation: Megatron-FSDP runs with parallel.pipeline=1 (one chunk)
        raise ValueError(f"the fsdp_dtensor format holds one model chunk, this rank has {len(model)}")
    state = {"step": step, "consumed_samples": consumed, "scheduler": scheduler.state_dict(),
             "model": model[0].state_dict_for_save_checkpoint()}
    if is_loading:  # Megatron's own dummy states first (sharded_state_dict makes them again; harmless)
        optimizer._init_optimizer_states_with_dummy_values()
    _state_for_empty_shards(optimizer)
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading,
                                                      metadata={"distrib_optim_sharding_type": FORMAT})
    # the same keys in the same order on every rank: the gated-fc1 split below runs collectives per key
    state["optimizer"]["state"] = dict(sorted(state["optimizer"]["state"].items()))
    state[_rng_key()] = _rng_state()
    return state


def _flags(model) -> dict:
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    return {"gated": bool(config.gated_linear_unit), "num_experts": config.num_moe_experts}


def save(path: Path, *, model, optimizer, scheduler, step: int, consumed: int) -> None:
    """Collective: write this run's state into ``path`` (an empty directory) in the fsdp_dtensor format."""
    import torch.distributed.checkpoint as dcp

    state = _preprocess(state_dict(model, optimizer, scheduler, step=step, consumed=consumed, is_loading=False),
                        model[0], **_flags(model))
    dcp.save(state_dict=state, storage_writer=dcp.FileSystemWriter(str(path)))


def load(path: Path, *, model, optimizer, scheduler, with_rng: bool, converted=None) -> tuple:
    """Collective: fill model, optimizer, LR schedule (and this rank's RNG streams) from ``path``; returns
    (step, consumed samples, the RNG snapshot or None). Strict: a tensor missing from the checkpoint fails.
    ``converted``: a torch_dist checkpoint opened for streaming (``checkpoint_convert.Source``) to fill in from."""
    import torch.distributed.checkpoint as dcp

    raw = state_dict(model, optimizer, scheduler, step=0, consumed=0, is_loading=True)
    if not with_rng:
        raw.pop(_rng_key())
    template = _preprocess(raw, model[0], **_flags(model))
    if converted is None:
        dcp.load(state_dict=template, storage_reader=dcp.FileSystemReader(str(path)))
    else:
        from launcher.rank.checkpoint.convert import fill_fsdp

        fill_fsdp(template, converted, _rng_key() if with_rng else None)
    model[0].load_state_dict(raw["model"], strict=False)  # the adapter loosens it for gated models itself
    with torch.no_grad():
        optimizer.load_state_dict(raw["optimizer"])
    if hasattr(scheduler, "num_steps"):  # Megatron's scheduler adds the saved steps to its own (see checkpoint.load)
        scheduler.num_steps = 0
    scheduler.load_state_dict(template["scheduler"])
    rng = template.get(_rng_key()) if with_rng else None
    snapshot = None if rng is None else (rng["cpu"], rng["tracker"],
                                         rng.get("cuda") if torch.cuda.is_available() else None)
    return int(template["step"]), int(template["consumed_samples"]), snapshot
