"""Megatron's distributed-optimizer state through a checkpoint (``launcher/rank/checkpoint/store.py`` save and load):
what its load template needs, and the upstream bugs of Megatron-Core 0.19.2 with torch Adam (no Apex/TE) that a
resume would otherwise carry into training, each worked around where it bites.
"""
from __future__ import annotations

import torch


def materialize_optimizer_state(optimizer) -> None:
    """A fresh torch Adam has no state yet, and DistributedOptimizer.state_dict() (needed to build the load
    template) asserts one common 'step' across its states. Take one step with zero grads and lr=0 (params
    unchanged; weight decay is scaled by lr too) so the state exists; loading then overwrites it."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(opt, DistributedOptimizer) or inner is None or len(inner.state) > 0:
            continue
        saved_lr = [group["lr"] for group in inner.param_groups]
        for group in inner.param_groups:
            group["lr"] = 0.0
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        inner.step()
        inner.zero_grad(set_to_none=True)
        for group, lr in zip(inner.param_groups, saved_lr):
            group["lr"] = lr


def restore_adam_steps(optimizer, loaded: dict) -> None:
    """Upstream bugs (0.19.2 DistributedOptimizer with torch Adam, no Apex/TE), found by our resume test:
    load_state_dict gives every parameter's Adam state the *same* 'step' tensor (torch then increments it
    once per parameter per step), and the dp_reshardable parameter-state copy then overwrites that tensor
    with the load template's placeholder step. Either way bias correction is wrong after a resume. The
    saved param_groups carry the right step: give each parameter state its own tensor with that value."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    for i, opt in enumerate(chained):
        if not isinstance(opt, DistributedOptimizer):
            continue
        sub = loaded if len(chained) == 1 else loaded[i]
        steps = {float(g["step"]) for g in sub["optimizer"]["param_groups"] if "step" in g}
        if len(steps) != 1:
            continue
        step = steps.pop()
        for st in opt.optimizer.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = torch.tensor(step, dtype=st["step"].dtype, device=st["step"].device)


class _MissingIsNone(dict):
    def __missing__(self, key):
        return None


def tolerate_missing_adam_step() -> None:
    """Upstream bug (0.19.2, torch Adam): load_parameter_state_from_fully_reshardable leaves torch Adam's 'step'
    out of the tensors it hands to _set_main_param_and_optimizer_states, which then indexes them by every key of
    the live state ('step' included): KeyError: 'step'. Missing keys now mean "keep"; the step itself is
    restored from the saved param_groups by restore_adam_steps. Idempotent."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_tolerant", False):
        return

    def tolerant(self, model_param, tensors):
        return original(self, model_param, _MissingIsNone(tensors))

    tolerant._tolerant = True
    DistributedOptimizer._set_main_param_and_optimizer_states = tolerant


def cpu_tensors_stay():
    """On CPU, fully_reshardable's gather/scatter over DP calls ``Tensor.cuda()``: make it the identity there."""
    import contextlib

    if torch.cuda.is_available():
        return contextlib.nullcontext()
    from models.cpu_compat import _tensor_cuda_is_identity

    return _tensor_cuda_is_identity()
