"""Read a Megatron-Core ``torch_dist`` checkpoint one tensor (one layer, one expert) at a time, in one process.

A torch_dist checkpoint is a PyTorch distributed checkpoint (``.metadata`` + ``__<rank>_<n>.distcp``) whose keys
are Megatron-Core's ``ShardedTensor`` keys and whose tensors are the *global* tensors, stored as the chunks each
rank wrote (``TorchDistSaveShardedStrategy``, megatron/core/dist_checkpointing/strategies/torch.py). The global
tensor is the TP=1 layout whatever TP/PP/EP it was written at, so the layout does not matter here.

Reading is PyTorch's own: ``torch.distributed.checkpoint.load(..., no_dist=True)`` with a planner that asks for one
slice (a layer of a stacked key, an expert) and lets ``create_read_items_for_chunk_list`` (the resharding
algorithm DCP uses for every load) pick the stored chunks that overlap it, so only those bytes are read. No
process group and no Megatron-Core import are needed: Megatron's own loader would want a process group, and with
a world of one it cannot describe a partial read (``sharded_tensor_to_torch_sharded_tensor`` places every other
fragment on "another" rank, which is rank 0 again).

Two layer layouts exist on disk (``TransformerBlock.sharded_state_dict``, megatron/core/transformer/
transformer_block.py): per-layer keys ``decoder.layers.{i}.…`` (MoE patterns, heterogeneous blocks) and stacked
keys ``decoder.layers.…`` with a leading layer axis (homogeneous layers). :meth:`Reader.locate` maps a per-layer
name onto whichever the checkpoint has.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Optional, Tuple

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

_LAYER = re.compile(r"^((?:decoder|mtp)\.layers)\.(\d+)\.(.+)$")
MODEL_PREFIXES = ("embedding", "decoder", "output_layer", "mtp")


class _CachedReader(FileSystemReader):
    """The checkpoint's metadata read once, not once per tensor."""

    _metadata = None

    def read_metadata(self):
        if self._metadata is None:
            self._metadata = super().read_metadata()
        return self._metadata


class _SlicePlanner(DefaultLoadPlanner):
    """Reads ``key[offsets : offsets + dest.shape]`` into ``dest``."""

    def __init__(self, key: str, offsets: Tuple[int, ...], dest: torch.Tensor):
        super().__init__()
        self._key, self._offsets, self._dest = key, offsets, dest

    def create_local_plan(self) -> LoadPlan:
        wanted = ChunkStorageMetadata(offsets=torch.Size(self._offsets), sizes=self._dest.shape)
        return LoadPlan(create_read_items_for_chunk_list(self._key, self.metadata.state_dict_metadata[self._key],
                                                         [wanted]))

    def resolve_tensor(self, read_item):
        view = self._dest
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # resolve_tensor handed out a view of dest: the bytes are in place


class Reader:
    """Global tensors of one checkpoint, by key and leading index."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._storage = _CachedReader(str(self.path))
        self.meta = {k: v for k, v in self._storage.read_metadata().state_dict_metadata.items()
                     if isinstance(v, TensorStorageMetadata)}

    def locate(self, candidates: Iterable[str], index: Tuple[int, ...] = ()) -> Optional[Tuple[str, tuple]]:
        """(stored key, full leading index) of the first candidate the checkpoint holds, or None."""
        for name in candidates:
            if name in self.meta:
                return name, tuple(index)
            m = _LAYER.match(name)
            if m and f"{m[1]}.{m[3]}" in self.meta:
                return f"{m[1]}.{m[3]}", (int(m[2]), *index)
        return None

    def shape(self, key: str, index: tuple = ()) -> torch.Size:
        return torch.Size(self.meta[key].size[len(index):])

    def dtype(self, key: str) -> torch.dtype:
        return self.meta[key].properties.dtype

    def read(self, key: str, index: tuple = ()) -> torch.Tensor:
        """The global tensor ``key[index]`` (leading axes indexed), read from disk now."""
        rest = self.shape(key, index)
        dest = torch.empty((1,) * len(index) + tuple(rest), dtype=self.dtype(key))
        planner = _SlicePlanner(key, tuple(index) + (0,) * len(rest), dest)
        dcp_load({key: dest}, storage_reader=self._storage, planner=planner, no_dist=True)
        return dest.reshape(rest)

    def model_keys(self) -> list:
        """Stored keys of the model's weights (not the optimizer's or RNG state)."""
        return sorted(k for k in self.meta if k.split(".")[0] in MODEL_PREFIXES)
