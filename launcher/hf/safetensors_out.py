"""Sharded ``model-0000x-of-0000y.safetensors`` + ``model.safetensors.index.json``, written one tensor at a time.

``safetensors.torch.save_file`` takes a whole state dict in memory; a shard of several GB would then be held at
once. The format is simple enough to write as a stream (safetensors' README, "Format"): an 8-byte little-endian
header length, a JSON header (name -> dtype, shape, [begin, end) byte offsets into the data; ``__metadata__``
with ``{"format": "pt"}``, which transformers checks), padded with spaces to 8 bytes, then the raw bytes in
offset order. All shapes and dtypes are known before any tensor is read (the plan), so each header is written
first and each tensor's bytes follow as soon as it is converted. Files are read back with ``safetensors``' own
``safe_open`` in the tests.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


def plan_shards(entries: Sequence[Tuple[str, torch.Size, torch.dtype]], max_shard_bytes: int) -> List[List[int]]:
    """Entry indices per shard, in order: a new shard starts when the next tensor would pass the limit (a tensor
    larger than the limit gets a shard of its own), as transformers' ``save_pretrained(max_shard_size=...)``."""
    shards, size = [[]], 0
    for i, (_, shape, dtype) in enumerate(entries):
        n = nbytes(shape, dtype)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += n
    return shards


def shard_name(k: int, total: int) -> str:
    return f"model-{k + 1:05d}-of-{total:05d}.safetensors"


class ShardWriter:
    """One shard file: the header up front (from the plan), then each tensor's bytes as it comes."""

    def __init__(self, path: Path, entries: Sequence[Tuple[str, torch.Size, torch.dtype]]):
        header: Dict[str, dict] = {"__metadata__": {"format": "pt"}}
        offset = 0
        self._expected = []
        for name, shape, dtype in entries:
            n = nbytes(shape, dtype)
            header[name] = {"dtype": DTYPES[dtype], "shape": [int(d) for d in shape],
                            "data_offsets": [offset, offset + n]}
            self._expected.append((name, tuple(shape), dtype))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._fh = open(path, "wb")
        self._fh.write(struct.pack("<Q", len(raw)))
        self._fh.write(raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want = self._expected[self._next]
        got = (name, tuple(tensor.shape), tensor.dtype)
        if got != want:  # the plan and the conversion disagree: a bug here, never a silently wrong file
            raise RuntimeError(f"safetensors stream: expected {want}, got {got}")
        self._fh.write(memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._expected):
            raise RuntimeError(f"safetensors stream: {len(self._expected) - self._next} tensor(s) never written")
        self._fh.flush()
        import os

        os.fsync(self._fh.fileno())
        self._fh.close()


def write_index(path: Path, weight_map: Dict[str, str], total_size: int) -> None:
    path.write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2) + "\n")
