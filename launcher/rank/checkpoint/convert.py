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
- fsdp_dtensor (``launcher/rank/checkpoint/fsdp.py``): one key per parameter of the module tree
  (``model.module.decoder.layers.0.input_layernorm.weight``), gated fc1 split into ``weight_w``/``weight_v``;
  Adam's moments as ``optimizer.state.module.module.<name>.{exp_avg,exp_avg_sq,step}``; the RNG streams under
  ``rng_state/pp<pp>_tp<tp>_dp<dp>``.

The common ground is the model's own parameter names with TP=1 global tensors (``Canonical``'s names). Each rank
streams, without a process group: it opens the source's metadata (``Source``), reads the small entries (counters,
LR schedule, Adam's step, RNG streams) once, then walks its own load template (the ShardedTensors of the DDP job,
or the DTensors of the FSDP job) and for each entry reads from the source only the box that entry holds (a DCP
``LoadPlanner`` over DCP's ``create_read_items_for_chunk_list``: only the stored chunks that overlap the box are
opened), copies it in and drops it. Peak host memory per rank: its load template (what a load of its own format
fills too) plus one box and one stored chunk at a time. DCP's ``FileSystemReader`` loads a stored chunk whole
before narrowing it, so the transient is the largest stored chunk touched: one layer's tensor in torch_dist
(stored per layer), one FSDP rank's shard of one parameter, at worst an unsharded fp32 embedding or output layer
(2.1 GB for Llama3-8B's 128256 x 4096), where reading the whole source took the whole checkpoint per rank (about
100 GB for Llama3-8B with its fp32 main weights and Adam moments). From there the load is the format's own
(``checkpoint.load`` / ``fsdp_checkpoint.load``). Values are copied, never recomputed, so weights and Adam state
convert bit for bit. ``read_all`` (the whole checkpoint in memory) with ``from_fsdp``/``from_torch_dist`` is the
independent whole-checkpoint reader the tests compare against; the ranks do not call it.

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

from launcher.core.checkpoint.resume_rules import conversion_refusal as refusal  # noqa: F401 (the ranks' and the
# login node's resume plan's one rule of what converts: launcher/core/checkpoint/resume_rules.py)

FSDP = "fsdp_dtensor"
TORCH_DIST = "torch_dist"
MOMENTS = ("exp_avg", "exp_avg_sq")
_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


# ---- reading a whole checkpoint (tests) ---------------------------------------------------------------------

def read_all(path: Path) -> Dict[str, object]:
    """Every entry of a torch.distributed.checkpoint directory, global tensors and objects by flat key, read in
    this process alone: the whole checkpoint in memory, for tests and inspection (the ranks stream: ``Source``)."""
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


def read(path: Path, saved: str, model) -> "Source":
    """The source checkpoint opened for streaming (its metadata and small entries read; tensors on demand)."""
    return Source(path, saved, keys_map_of(model))


# ---- reading a checkpoint box by box (the ranks) ---------------------------------------------------------------

def _map(rest: str, keys_map: Dict[str, str]) -> str:
    """A layer's module-name suffix to its sharded-key suffix (``sharded_state_dict_keys_map``; inverse ``_unmap``)."""
    for module_name, stored in keys_map.items():
        if rest.startswith(module_name):
            return stored + rest[len(module_name):]
    return rest


def _is_small(key: str, meta, saved: str) -> bool:
    """Entries ``from_fsdp``/``from_torch_dist`` take the counters, schedule, Adam step and RNG streams from
    (kilobytes); not the parameter-group metadata nor the linear layers' empty ``_extra_state``."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    if saved == FSDP:
        if isinstance(meta, BytesStorageMetadata):
            return not key.startswith("optimizer.param_to_group_meta.")
        return key.startswith("rng_state/") or (key.startswith("optimizer.state.") and key.endswith(".step"))
    return isinstance(meta, BytesStorageMetadata) and key.startswith(("common_state/", "rng_state/"))


class _BoxPlanner:
    """Reads one box (``offsets``/``sizes``) of one stored tensor into ``dest``: DCP's own resharding arithmetic
    (``create_read_items_for_chunk_list``) names the stored chunks that overlap the box and where in the box each
    lands, so no other chunk is opened. It is the part of DCP's ``LoadPlanner`` protocol that a storage reader's
    ``read_data`` calls; ``Source`` drives the reader itself (one process, no plan exchange)."""

    def __init__(self, key: str, offsets, sizes, dest: torch.Tensor, metadata):
        self.key, self.offsets, self.sizes, self.dest, self.metadata = key, offsets, sizes, dest, metadata

    def create_local_plan(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        box = ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.sizes))
        return LoadPlan(create_read_items_for_chunk_list(self.key, self.metadata.state_dict_metadata[self.key], [box]))

    def resolve_tensor(self, item) -> torch.Tensor:  # the reader copies each overlap into this view of the box
        view = self.dest
        for dim, (offset, length) in enumerate(zip(item.dest_offsets, item.lengths)):
            view = view.narrow(dim, offset, length)
        return view

    def commit_tensor(self, item, tensor) -> None:
        pass  # written in place, through resolve_tensor's view

    def load_bytes(self, item, value) -> None:
        raise TypeError(f"{self.key} is stored as an object, not a tensor")


class Source:
    """A checkpoint of either format, read on demand in ``Canonical``'s names (the model's parameter names, global
    layer numbers, TP=1 global tensors) without being held: ``region`` reads one box of one tensor from the stored
    chunks that overlap it, in this process alone (no collectives). ``small``: a ``Canonical`` without tensors
    (counters, LR schedule, Adam's step, RNG streams), read once. Kinds of tensor: ``model``, ``main`` (the fp32
    main weights, the model's own where the checkpoint has none), ``exp_avg``, ``exp_avg_sq``."""

    def __init__(self, path: Path, saved: str, keys_map: Dict[str, str]):
        import torch.distributed.checkpoint as dcp

        self.saved, self.keys_map = saved, keys_map
        self.reader = dcp.FileSystemReader(str(path))
        self.meta = self.reader.read_metadata()
        self.reader.set_up_storage_reader(self.meta, True)
        entries = self.meta.state_dict_metadata
        small = _read_entries(path, self.meta, [k for k, m in entries.items() if _is_small(k, m, saved)])
        self.small = from_fsdp(small) if saved == FSDP else from_torch_dist(small, keys_map)

    def _prefixes(self, kind: str) -> list:
        """(prefix, suffix) of the stored keys of ``kind``, in order of preference."""
        if self.saved == FSDP:  # fsdp_dtensor's model entries are its fp32 main weights
            return [("optimizer.state.module.module.", "." + kind)] if kind in MOMENTS else [("model.module.", "")]
        if kind in MOMENTS:
            return [(f"optimizer.state.{kind}.", "")]
        main = [("optimizer.state.param.", ""), ("optimizer.state.fp32_param.", "")] if kind == "main" else []
        return main + [("", "")]

    def _piece(self, key: str, layer: Optional[int] = None) -> Optional[tuple]:
        """(key, layer, first row, rows): dim 0 of a stored tensor (of one layer of a stacked one), or None."""
        meta = self.meta.state_dict_metadata.get(key)
        if meta is None or not hasattr(meta, "size") or len(meta.size) < (2 if layer is not None else 1):
            return None
        if layer is not None and layer >= meta.size[0]:
            return None
        return (key, layer, 0, meta.size[0 if layer is None else 1])

    def _pieces(self, kind: str, name: str) -> list:
        """The stored rows canonical ``name`` is made of, in order along its dim 0 ([] where it is not stored).
        ``X_w``/``X_v`` asked of a checkpoint that holds a gated ``X`` are its first and second half."""
        for prefix, suffix in self._prefixes(kind):
            found = self._stored(prefix, suffix, name)
            if not found and name[-2:] in ("_w", "_v"):
                whole = self._stored(prefix, suffix, name[:-2])
                half = sum(p[3] for p in whole) // 2
                found = _rows(whole, 0 if name.endswith("_w") else half, half) if whole else []
            if found:
                return found
        return []

    def _stored(self, prefix: str, suffix: str, name: str) -> list:
        """fsdp_dtensor: ``name``, or a gated ``X`` as ``X_w`` then ``X_v``; torch_dist: per-layer tensors in a
        stacked key (leading axis: the global layer number) or a per-layer one, under the layer spec's names."""
        if self.saved == FSDP:
            found = [self._piece(prefix + name + suffix)]
            if found[0] is None:
                found = [self._piece(prefix + name + half + suffix) for half in ("_w", "_v")]
        else:
            match = _PER_LAYER.match(name)
            rest = match and _map(match[2], self.keys_map)
            found = [self._piece(prefix + name + suffix) if not match else
                     self._piece(f"{prefix}decoder.layers.{match[1]}.{rest}{suffix}")
                     or self._piece(f"{prefix}decoder.layers.{rest}{suffix}", int(match[1]))]
        return found if all(found) else []

    def shape(self, kind: str, name: str, what: str) -> tuple:
        pieces = self._pieces(kind, name)
        if not pieces:
            raise _missing(what, name)
        key, layer = pieces[0][:2]
        inner = tuple(self.meta.state_dict_metadata[key].size)[(0 if layer is None else 1) + 1:]
        return (sum(p[3] for p in pieces),) + inner

    def region(self, kind: str, name: str, offsets, sizes, what: str) -> torch.Tensor:
        """The box ``offsets``/``sizes`` of canonical tensor ``name`` of ``kind``, in its stored dtype: a new tensor
        of the box's size, read from the stored chunks it overlaps; nothing else is kept."""
        pieces = self._pieces(kind, name)
        if not pieces:
            raise _missing(what, name)
        parts = [self._read(key, layer, (first,) + tuple(offsets[1:]), (rows,) + tuple(sizes[1:]))
                 for key, layer, first, rows in _rows(pieces, offsets[0], sizes[0])]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def _read(self, key: str, layer: Optional[int], offsets: tuple, sizes: tuple) -> torch.Tensor:
        if layer is not None:  # one layer of a stacked tensor
            offsets, sizes = (layer,) + offsets, (1,) + sizes
        meta = self.meta.state_dict_metadata[key]
        box = torch.empty(sizes, dtype=meta.properties.dtype, device="cpu")  # host: read from files
        planner = _BoxPlanner(key, offsets, sizes, box, self.meta)
        (plan,) = self.reader.prepare_global_plan([self.reader.prepare_local_plan(planner.create_local_plan())])
        self.reader.read_data(plan, planner).wait()
        return box[0] if layer is not None else box


def _rows(pieces: list, start: int, count: int) -> list:
    """The pieces (key, layer, first row, rows) that hold rows [start, start + count) of their concatenation."""
    out, at = [], 0
    for key, layer, first, rows in pieces:
        lo, hi = max(start, at), min(start + count, at + rows)
        if lo < hi:
            out.append((key, layer, first + lo - at, hi - lo))
        at += rows
    return out


def _read_entries(path: Path, meta, keys: list) -> Dict[str, object]:
    """The entries ``keys`` (small ones) of a checkpoint, by flat key."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    entries = meta.state_dict_metadata
    state = {k: None if isinstance(entries[k], BytesStorageMetadata) else
             torch.empty(entries[k].size, dtype=entries[k].properties.dtype, device="cpu") for k in keys}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return state


def _rank_coords() -> tuple:
    from megatron.core import parallel_state as ps

    return (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
            ps.get_data_parallel_rank(with_context_parallel=True))


def _missing(what: str, name: str):
    return KeyError(f"the checkpoint has no {what} for {name}")


# ---- into a DDP job's torch_dist load template -----------------------------------------------------------------

def _flat_box(offsets: list, sizes: list, flat: Optional[slice]) -> tuple:
    """The rows of a box that hold its flattened range (the distributed optimizer's slice of a parameter): (offsets,
    sizes, the range within those rows), so a rank reads its slice, not the whole parameter."""
    if flat is None or not sizes:
        return offsets, sizes, None
    row = 1
    for size in sizes[1:]:
        row *= size
    first, last = flat.start // row, -(-flat.stop // row)
    return ([offsets[0] + first] + offsets[1:], [last - first] + sizes[1:],
            slice(flat.start - first * row, flat.stop - first * row))


def torch_dist_state(template: dict, source: Source, keys_map: Dict[str, str]) -> dict:
    """What ``dist_checkpointing.load(template, path)`` returns, filled from ``source``: every ShardedTensor becomes
    its slice of the global tensor, read box by box; factories are merged back; the common state is the source's."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values
    from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor, ShardedTensorFactory,
                                                          apply_factories, apply_factory_merges)

    small = source.small
    rank_rng = small.rng.get(_rank_coords())

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
        key, kind = sh.key, "model"
        if key.startswith("optimizer.state."):
            moment, _, key = key[len("optimizer.state."):].partition(".")
            kind = moment if moment in MOMENTS else "main"
        name, _ = name_and_layer(key, sh.global_offset)
        axes = sh.prepend_axis_num
        offsets, sizes, flat = _flat_box(list(sh.global_offset[axes:]), list(sh.local_shape), sh.flattened_range)
        value = source.region(kind, name, offsets, sizes, sh.key)
        if flat is not None:
            value = value.flatten()[flat]
        if sh.data is not None and tuple(sh.data.shape) == tuple(value.shape):
            # into the template's own tensor, as dist_checkpointing.load does: a second copy of every tensor the
            # rank loads would double the load's own footprint (copy_ casts as .to(dtype) does: same bits)
            with torch.no_grad():
                sh.data.copy_(value)
            return sh.data
        return value.to(sh.dtype).clone().to("cpu" if sh.data is None else sh.data.device)  # clone: a view's rows

    factories, _ = extract_matching_values(template, lambda x: isinstance(x, ShardedTensorFactory),
                                           return_lists_as_dicts=True)  # as dist_checkpointing.load does
    apply_factories(template)
    dict_list_map_inplace(fill, template)
    state = apply_factory_merges(template, factories)
    state["step"], state["consumed_samples"], state["scheduler"] = small.step, small.consumed, dict(small.scheduler)
    if small.adam_step is not None:
        for group in _param_groups(state.get("optimizer", {})):
            if "step" in group:
                group["step"] = small.adam_step
    return state


# ---- into an FSDP job's fsdp_dtensor load template -------------------------------------------------------------

def _local_chunk(dt):
    """(offsets, sizes) of this rank's piece of a Megatron-FSDP DTensor (uneven shards carry their own chunk list
    after ``preprocess_state_dict_for_uneven_dtensor``)."""
    local = dt._local_tensor
    chunks = local.__create_chunk_list__() if hasattr(local, "__create_chunk_list__") else dt.__create_chunk_list__()
    chunk = chunks[0]
    return tuple(chunk.offsets), tuple(chunk.sizes)


def _copy_into(dt, source: Source, kind: str, name: str, what: str, key: str) -> None:
    shape = source.shape(kind, name, what)
    if shape != tuple(dt.shape):
        raise ValueError(f"{key}: {shape} in the checkpoint, {tuple(dt.shape)} in this model")
    offsets, sizes = _local_chunk(dt)
    if 0 in sizes:
        return
    piece = source.region(kind, name, offsets, sizes, what)  # this rank's shard only
    with torch.no_grad():
        dt._local_tensor.copy_(piece.reshape(dt._local_tensor.shape))


def fill_fsdp(template: dict, source: Source, rng_key: Optional[str]) -> None:
    """Fill an fsdp_dtensor load template (``fsdp_checkpoint`` after preprocessing) in place from ``source``."""
    from torch.distributed.tensor import DTensor

    small = source.small
    for key, value in template["model"].items():  # Megatron-FSDP's model entries are its fp32 main weights
        if isinstance(value, DTensor):
            _copy_into(value, source, "main", key[len("module."):], "weight", key)
    for key, entry in template.get("optimizer", {}).get("state", {}).items():
        name = key[len("module.module."):]
        for moment in MOMENTS:
            if isinstance(entry.get(moment), DTensor):
                _copy_into(entry[moment], source, moment, name, moment, f"{key}.{moment}")
        if torch.is_tensor(entry.get("step")) and small.adam_step is not None:
            entry["step"].fill_(small.adam_step)
    template["step"], template["consumed_samples"] = small.step, small.consumed
    template["scheduler"] = dict(small.scheduler)
    if rng_key is not None:
        template[rng_key] = small.rng[_rank_coords()]
