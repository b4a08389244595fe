"""Continue a job from a checkpoint of the other format: torch_dist (Megatron DDP) <-> fsdp_dtensor (Megatron-FSDP).

A job that switches ``parallel.megatron_fsdp`` reads the checkpoint it finds in the other format and converts it in
memory on its ranks; it then saves in its own format (the source checkpoint is only read, never touched).

Both formats are torch.distributed.checkpoint directories of *global* tensors, named differently:

- torch_dist (``dist_checkpointing``): Megatron-Core's sharded keys; homogeneous layers stacked on a leading layer
  axis (``decoder.layers.self_attention.linear_qkv.weight`` of shape (L, ...)), layer norms under the names the
  layer spec maps them to (``sharded_state_dict_keys_map``: the local spec stores ``input_layernorm.weight`` as
  ``self_attention.linear_qkv.layer_norm_weight``, TE's fused name); Adam's moments and the fp32 main weights per
  parameter as ``optimizer.state.{exp_avg,exp_avg_sq,param}.<key>`` (``checkpoint.optimizer_format=
  fully_reshardable``, and Megatron's non-distributed optimizer); step, scheduler and parameter groups in
  ``common_state``; the RNG streams per (PP, TP, DP) rank in ``rng_state/shard_<pp>.<tp>.<dp>_...``.
- fsdp_dtensor (``launcher/rank/fsdp_checkpoint.py``): one key per parameter of the module tree
  (``model.module.decoder.layers.0.input_layernorm.weight``), gated fc1 split into ``weight_w``/``weight_v``;
  Adam's moments as ``optimizer.state.module.module.<name>.{exp_avg,exp_avg_sq,step}``; the RNG streams under
  ``rng_state/pp<pp>_tp<tp>_dp<dp>``.

The common ground is the model's own parameter names with TP=1 global tensors (``Canonical``). Each rank reads the
whole source checkpoint without a process group (``dcp.load(..., no_dist=True)``: host memory for one full copy
of the checkpoint per rank, fine below a few billion parameters, not meant for 70B), then fills its own load
template (the ShardedTensors of the DDP job, or the DTensors of the FSDP job) with the slice each entry names;
from there the load is the format's own (``checkpoint.load`` / ``fsdp_checkpoint.load``). Values are copied,
never recomputed, so weights and Adam state convert bit for bit.

What cannot convert (``refusal``): ``checkpoint.optimizer_format=dp_reshardable`` (the default) stores the
distributed optimizer's state as each DP rank's flat slice of its gradient buffer, whose layout depends on the
bucket and padding of that run: no per-parameter tensor to map; MoE experts (their own key layouts: torch_dist's
expert axis, fsdp_dtensor's ``handle_experts_in_state_dict``; not written here); tensor parallelism on the
fsdp_dtensor side (the gated-fc1 split of TP-sharded DTensors was not verified here); fp16 (its loss scaler is not
mapped). In bf16, torch_dist holds bf16 weights plus the fp32 main weights (``optimizer.state.param``) and
fsdp_dtensor holds the fp32 main weights as its model entries: the fp32 copy is what crosses, each side casts its
compute weights from it.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Optional

import torch

from launcher.core.resume_rules import conversion_refusal as refusal  # noqa: F401 (the ranks' and the
# login node's resume plan's one rule of what converts: launcher/core/resume_rules.py)

FSDP = "fsdp_dtensor"
TORCH_DIST = "torch_dist"
MOMENTS = ("exp_avg", "exp_avg_sq")
_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


# ---- reading a whole checkpoint --------------------------------------------------------------------------------

def read_all(path: Path) -> Dict[str, object]:
    """Every entry of a torch.distributed.checkpoint directory, global tensors and objects by flat key, read in
    this process alone (no collectives: every rank reads its own copy)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    meta = reader.read_metadata().state_dict_metadata
    # host buffers on purpose: read from files, sliced on the host, copied onto each live tensor's own device
    state = {k: None if isinstance(m, BytesStorageMetadata) else
             torch.empty(m.size, dtype=m.properties.dtype, device="cpu") for k, m in meta.items()}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


class Canonical:
    """A checkpoint in the model's own parameter names (global layer numbers, TP=1 tensors)."""

    def __init__(self):
        self.model: Dict[str, torch.Tensor] = {}
        self.moments: Dict[str, Dict[str, torch.Tensor]] = {m: {} for m in MOMENTS}
        self.main: Dict[str, torch.Tensor] = {}  # fp32 main weights where the checkpoint has them
        self.step = self.consumed = 0
        self.adam_step: Optional[float] = None
        self.scheduler: dict = {}
        self.rng: Dict[tuple, dict] = {}  # (pp, tp, dp) -> {"cpu", "tracker"[, "cuda"]}


def _merge_gated(flat: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """fsdp_dtensor's ``X_w``/``X_v`` halves back into ``X`` (Megatron-Core's gated fc1 is [W; V] on dim 0)."""
    out = {}
    for name, value in flat.items():
        if name.endswith("_v") and name[:-2] + "_w" in flat:
            continue
        if name.endswith("_w") and name[:-2] + "_v" in flat:
            out[name[:-2]] = torch.cat([value, flat[name[:-2] + "_v"]], dim=0)
        else:
            out[name] = value
    return out


def _unflatten(flat: Dict[str, object], prefix: str) -> dict:
    out: dict = {}
    for key, value in flat.items():
        if key.startswith(prefix):
            node = out
            *parents, leaf = key[len(prefix):].split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
    return out


def from_fsdp(flat: Dict[str, object]) -> Canonical:
    can = Canonical()
    can.model = _merge_gated({k[len("model.module."):]: v for k, v in flat.items() if k.startswith("model.module.")})
    state = "optimizer.state.module.module."
    for moment in MOMENTS + ("step",):
        part = {k[len(state):-len(moment) - 1]: v for k, v in flat.items()
                if k.startswith(state) and k.endswith("." + moment)}
        if moment == "step":
            steps = {float(v) for v in part.values()}
            can.adam_step = steps.pop() if len(steps) == 1 else None
        else:
            can.moments[moment] = _merge_gated(part)
    can.step, can.consumed = int(flat["step"]), int(flat["consumed_samples"])
    can.scheduler = _unflatten(flat, "scheduler.")
    for key in {k.split(".")[0] for k in flat if k.startswith("rng_state/")}:
        pp, tp, dp = map(int, re.match(r"rng_state/pp(\d+)_tp(\d+)_dp(\d+)$", key).groups())
        can.rng[(pp, tp, dp)] = _unflatten(flat, key + ".")
    return can


def _unmap(rest: str, keys_map: Dict[str, str]) -> str:
    """A layer's sharded-key suffix back to its module name (inverse of ``sharded_state_dict_keys_map``)."""
    for module_name, stored in keys_map.items():
        if rest.startswith(stored):
            return module_name + rest[len(stored):]
    return rest


def _per_layer(key: str, value: torch.Tensor, keys_map: Dict[str, str], out: Dict[str, torch.Tensor]) -> None:
    match = _PER_LAYER.match(key)
    if match:
        out[f"decoder.layers.{match[1]}.{_unmap(match[2], keys_map)}"] = value
    elif key.startswith("decoder.layers."):  # stacked: the leading axis is the global layer number
        rest = _unmap(key[len("decoder.layers."):], keys_map)
        for i in range(value.shape[0]):
            out[f"decoder.layers.{i}.{rest}"] = value[i]
    else:
        out[key] = value


def from_torch_dist(flat: Dict[str, object], keys_map: Dict[str, str]) -> Canonical:
    can = Canonical()
    tensors = {k: v for k, v in flat.items() if torch.is_tensor(v)}
    for key, value in tensors.items():
        if key.startswith("optimizer.state."):
            moment, _, name = key[len("optimizer.state."):].partition(".")
            target = can.moments.get(moment, can.main if moment in ("param", "fp32_param") else None)
            if target is not None:
                _per_layer(name, value, keys_map, target)
        elif not key.startswith("optimizer."):
            _per_layer(key, value, keys_map, can.model)
    (common,) = [v for k, v in flat.items() if k.startswith("common_state/")]
    common = common[0] if isinstance(common, list) else common
    can.step, can.consumed, can.scheduler = int(common["step"]), int(common["consumed_samples"]), common["scheduler"]
    steps = {float(g["step"]) for g in _param_groups(common.get("optimizer", {})) if "step" in g}
    can.adam_step = steps.pop() if len(steps) == 1 else None
    for key, value in flat.items():
        match = re.match(r"rng_state/shard_(\d+)\.(\d+)\.(\d+)_", key)
        if match:
            can.rng[tuple(map(int, match.groups()))] = value[0] if isinstance(value, list) else value
    return can


def _param_groups(opt: dict) -> list:
    """The param_groups lists anywhere in an optimizer's common state (one per chained optimizer)."""
    found = []
    if isinstance(opt, dict):
        for key, value in opt.items():
            if key == "param_groups" and isinstance(value, list):
                found.extend(g for g in value if isinstance(g, dict))
            else:
                found.extend(_param_groups(value))
    elif isinstance(opt, (list, tuple)):
        for value in opt:
            found.extend(_param_groups(value))
    return found


def keys_map_of(model) -> Dict[str, str]:
    """The layer spec's ``sharded_state_dict_keys_map`` (module name prefix -> stored prefix) of this model."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for chunk in model:
        for module in chunk.modules():
            if isinstance(module, TransformerLayer):
                return dict(getattr(module.submodules_config, "sharded_state_dict_keys_map", None) or {})
    return {}


def read(path: Path, saved: str, model) -> Canonical:
    flat = read_all(path)
    return from_fsdp(flat) if saved == FSDP else from_torch_dist(flat, keys_map_of(model))


def _rank_coords() -> tuple:
    from megatron.core import parallel_state as ps

    return (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
            ps.get_data_parallel_rank(with_context_parallel=True))


def _missing(what: str, name: str):
    return KeyError(f"the checkpoint has no {what} for {name}")


# ---- into a DDP job's torch_dist load template -----------------------------------------------------------------

def torch_dist_state(template: dict, can: Canonical, keys_map: Dict[str, str]) -> dict:
    """What ``dist_checkpointing.load(template, path)`` returns, filled from ``can``: every ShardedTensor becomes its
    slice of the global tensor, factories are merged back, the common state comes from the source checkpoint."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values
    from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor, ShardedTensorFactory,
                                                          apply_factories, apply_factory_merges)

    rank_rng = can.rng.get(_rank_coords())

    def name_and_layer(key: str, offsets):
        match = _PER_LAYER.match(key)
        if match:
            return f"decoder.layers.{match[1]}.{_unmap(match[2], keys_map)}", 0
        if key.startswith("decoder.layers."):
            return f"decoder.layers.{offsets[0]}.{_unmap(key[len('decoder.layers.'):], keys_map)}", 1
        return key, 0

    def fill(sh):
        if isinstance(sh, ShardedObject):
            if sh.key == "rng_state":
                return rank_rng
            return None  # the local spec's (empty) _extra_state of linear layers
        if not isinstance(sh, ShardedTensor):
            return sh
        key, source = sh.key, can.model
        if key.startswith("optimizer.state."):
            moment, _, key = key[len("optimizer.state."):].partition(".")
            source = can.moments[moment] if moment in can.moments else (can.main or can.model)
        name, stacked = name_and_layer(key, sh.global_offset)
        if name not in source:
            raise _missing(sh.key, name)
        axes = sh.prepend_axis_num
        index = tuple(slice(o, o + s) for o, s in zip(sh.global_offset[axes:], sh.local_shape))
        value = source[name][index].to(sh.dtype)
        if sh.flattened_range is not None:
            value = value.flatten()[sh.flattened_range]
        return value.clone().to(sh.data.device if sh.data is not None else "cpu")

    factories, _ = extract_matching_values(template, lambda x: isinstance(x, ShardedTensorFactory),
                                           return_lists_as_dicts=True)  # as dist_checkpointing.load does
    apply_factories(template)
    dict_list_map_inplace(fill, template)
    state = apply_factory_merges(template, factories)
    state["step"], state["consumed_samples"], state["scheduler"] = can.step, can.consumed, dict(can.scheduler)
    if can.adam_step is not None:
        for group in _param_groups(state.get("optimizer", {})):
            if "step" in group:
                group["step"] = can.adam_step
    return state


# ---- into an FSDP job's fsdp_dtensor load template -------------------------------------------------------------

def _local_chunk(dt):
    """(offsets, sizes) of this rank's piece of a Megatron-FSDP DTensor (uneven shards carry their own chunk list
    after ``preprocess_state_dict_for_uneven_dtensor``)."""
    local = dt._local_tensor
    chunks = local.__create_chunk_list__() if hasattr(local, "__create_chunk_list__") else dt.__create_chunk_list__()
    chunk = chunks[0]
    return tuple(chunk.offsets), tuple(chunk.sizes)


def _copy_into(dt, full: torch.Tensor, name: str) -> None:
    if tuple(full.shape) != tuple(dt.shape):
        raise ValueError(f"{name}: {tuple(full.shape)} in the checkpoint, {tuple(dt.shape)} in this model")
    offsets, sizes = _local_chunk(dt)
    if 0 in sizes:
        return
    piece = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    with torch.no_grad():
        dt._local_tensor.copy_(piece.reshape(dt._local_tensor.shape))


def _full(source: Dict[str, torch.Tensor], name: str, what: str) -> torch.Tensor:
    """The global tensor of ``name``; ``X_w``/``X_v`` are the two halves of a gated ``X`` on dim 0."""
    if name in source:
        return source[name]
    base = name[:-2]
    if name[-2:] in ("_w", "_v") and base in source:
        half = source[base].shape[0] // 2
        return source[base][:half] if name.endswith("_w") else source[base][half:]
    raise _missing(what, name)


def fill_fsdp(template: dict, can: Canonical, rng_key: Optional[str]) -> None:
    """Fill an fsdp_dtensor load template (``fsdp_checkpoint`` after preprocessing) in place from ``can``."""
    from torch.distributed.tensor import DTensor

    for key, value in template["model"].items():  # Megatron-FSDP's model entries are its fp32 main weights
        if isinstance(value, DTensor):
            name = key[len("module."):]
            source = can.main if name in can.main or name[:-2] in can.main else can.model
            _copy_into(value, _full(source, name, "weight"), key)
    for key, entry in template.get("optimizer", {}).get("state", {}).items():
        name = key[len("module.module."):]
        for moment in MOMENTS:
            if isinstance(entry.get(moment), DTensor):
                _copy_into(entry[moment], _full(can.moments[moment], name, moment), f"{key}.{moment}")
        if torch.is_tensor(entry.get("step")) and can.adam_step is not None:
            entry["step"].fill_(can.adam_step)
    template["step"], template["consumed_samples"] = can.step, can.consumed
    template["scheduler"] = dict(can.scheduler)
    if rng_key is not None:
        template[rng_key] = can.rng[_rank_coords()]
