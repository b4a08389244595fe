"""What the ranks refuse when they resume from a checkpoint saved at another layout or in another format, as plain
functions of the checkpoint's manifest (``launcher.json``) and the job's run identity: the ranks' resume
(``launcher/rank/checkpoint/store.py`` resume, ``launcher/rank/checkpoint/convert.py``) and the login node's resume plan
(``launcher/resume_plan.py``, printed by ``action=validate`` and ``action=plan``) read the same rules, so the plan
says what the ranks then do. Standard library only.

The rules and where they come from:

- Weights: a checkpoint of other model fields (``launcher/core/checkpoint/weights.py``) does not load.
- The distributed optimizer's ``checkpoint.optimizer_format=dp_reshardable`` state is each DP rank's flat slice of
  its gradient buckets (Megatron-Core ``optimizer/distrib_optimizer.py`` ``sharded_param_state_dp_reshardable``);
  with torch Adam it did not load back at another DP size here, so the ranks refuse a DP change
  (``dp_refusal``); ``fully_reshardable`` gathers per-parameter tensors and loads at any DP.
- The optimizer state's structure: Megatron's distributed optimizer and its plain one, and fp32 weights (no fp32
  main copy) and bf16/fp16 ones (an fp32 main copy in the optimizer state), hold different optimizer tensors; a
  checkpoint of one does not load into the other (``structure_refusal``; measured here on CPU, Megatron-Core
  0.19.2: distributed -> plain and plain -> distributed with dp_reshardable and with fully_reshardable, fp32 -> bf16
  with and without the distributed optimizer: every one failed in dist_checkpointing's load, after the model was
  built, with "CheckpointException ranks:dict_keys([0])" or "Could not find parameter group").
- torch_dist <-> fsdp_dtensor (``parallel.megatron_fsdp`` switched) converts on the ranks
  (``launcher/rank/checkpoint/convert.py``) except what ``conversion_refusal`` names.
- Everything else in the layout (TP, PP, VPP, EP, CP, DP) is resharded by dist_checkpointing: the tensors are
  stored with their global shapes and each rank reads its slice.
"""
from __future__ import annotations

from typing import Optional

FSDP = "fsdp_dtensor"
TORCH_DIST = "torch_dist"
DP_RESHARDABLE = "dp_reshardable"
FULLY_RESHARDABLE = "fully_reshardable"
DEFAULT_OPTIMIZER_FORMAT = DP_RESHARDABLE
"""The format the ranks assume for a manifest that names none (``launcher/rank/checkpoint/store.py``)."""


def saved_format(manifest: dict, dcp_only: bool) -> str:
    """The checkpoint format a manifest records; without one, fsdp_dtensor for a bare torch.distributed.checkpoint
    directory (``dcp_only``: no dist_checkpointing metadata.json), else torch_dist (the ranks' reading)."""
    return manifest.get("format") or (FSDP if dcp_only else TORCH_DIST)


def saved_dp(manifest: dict) -> Optional[int]:
    """The DP size (with CP) a checkpoint was saved at: its RNG layout's (PP, TP, DP), or None if unrecorded."""
    return (manifest.get("rng_layout") or [None] * 3)[2]


def optimizer_format_to_load(manifest: dict, converted: bool) -> str:
    """The optimizer layout the ranks load with: the manifest's, or fully_reshardable's per-parameter template for
    a checkpoint converted from the other format."""
    return FULLY_RESHARDABLE if converted else manifest.get("optimizer_format", DEFAULT_OPTIMIZER_FORMAT)


def dp_refusal(manifest: dict, *, distributed_optimizer: bool, fmt: str, dp_here: int,
               converted: bool = False) -> Optional[str]:
    """Why a distributed optimizer's dp_reshardable state cannot load at this DP size (``dp_here``, with CP), or
    None; the ranks' words (``launcher/rank/checkpoint/store.py`` resume)."""
    there = saved_dp(manifest)
    if (distributed_optimizer and fmt == TORCH_DIST and optimizer_format_to_load(manifest, converted) == DP_RESHARDABLE
            and there not in (None, dp_here)):
        return (f"its distributed-optimizer state was saved with checkpoint.optimizer_format=dp_reshardable at "
                f"DP={there}, this run has DP={dp_here}; resume at DP={there}, or save with "
                "checkpoint.optimizer_format=fully_reshardable")
    return None


def conversion_refusal(path, manifest: dict, saved: str, identity: dict) -> Optional[str]:
    """One line when a checkpoint in format ``saved`` cannot be converted for this job (identity: its flattened
    config), else None (``launcher/rank/checkpoint/convert.py`` says why each case is refused)."""
    theirs = manifest.get("identity") or {}
    back = "parallel.megatron_fsdp=true" if saved == FSDP else "parallel.megatron_fsdp=false"
    head = f"checkpoint {path} is in the {saved} format"
    opt_fmt = manifest.get("optimizer_format", DEFAULT_OPTIMIZER_FORMAT)
    if manifest.get("weights_only"):
        return (f"{head} and holds weights only (import-hf): loading those into a Megatron-FSDP job is not "
                f"implemented; continue it with {back}")
    if saved == TORCH_DIST and theirs.get("parallel.distributed_optimizer") and opt_fmt != FULLY_RESHARDABLE:
        return (f"{head} with checkpoint.optimizer_format={opt_fmt}: the distributed optimizer's state is each DP "
                "rank's flat buffer slice there, which cannot be converted to fsdp_dtensor; continue it with "
                f"{back}, and save with checkpoint.optimizer_format=fully_reshardable to get a checkpoint that "
                "converts")
    for key, ok, alt in (("model.num_experts", lambda v: not v, "null"),
                         ("precision.dtype", lambda v: v in ("fp32", "bf16"), "fp32|bf16")):
        for where, value in (("there", theirs.get(key)), ("here", identity.get(key))):
            if not ok(value):
                return (f"{head}: converting it to {FSDP if saved == TORCH_DIST else TORCH_DIST} is implemented for "
                        f"{key}={alt} only ({value!r} {where}); continue it with {back}")
    fsdp_tp, where = (((manifest.get("rng_layout") or [1, 1, 1])[1], "there") if saved == FSDP
                      else (identity.get("parallel.tensor"), "here"))
    if fsdp_tp not in (None, 1):
        return (f"{head}: converting between torch_dist and fsdp_dtensor is implemented at parallel.tensor=1 on the "
                f"Megatron-FSDP side only (TP={fsdp_tp} {where}); continue it with {back}")
    return None


def structure_refusal(manifest: dict, identity: dict, *, converted: bool) -> Optional[tuple]:
    """(field, the checkpoint's value, why) when the optimizer state's structure differs (see the module's notes),
    or None; a checkpoint converted from the other format, weights only, or without a recorded identity is not
    judged here."""
    theirs = manifest.get("identity") or {}
    if converted or manifest.get("weights_only") or not theirs:
        return None
    key = "parallel.distributed_optimizer"
    if key in theirs and bool(theirs[key]) != bool(identity.get(key)):
        return (key, theirs[key], f"its optimizer state was saved with {key}={_text(theirs[key])}, this run has "
                f"{_text(identity.get(key))}: the distributed optimizer's state and the plain optimizer's do not load "
                "into each other")
    key = "precision.dtype"
    there, here = theirs.get(key), identity.get(key)
    if there and here and (there == "fp32") != (here == "fp32"):
        return (key, there, f"it was saved with {key}={there}, this run has {here}: the optimizer state "
                f"{'holds no' if there == 'fp32' else 'holds an'} fp32 main copy of the weights, which "
                f"{here} training {'needs' if there == 'fp32' else 'does not have'}")
    return None


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
