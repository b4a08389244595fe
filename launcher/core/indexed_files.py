"""The Megatron ``.bin``/``.idx`` pair, read without Megatron (both wings: the login node's pre-flight,
``launcher/data_preflight.py``, and the ranks' check that the files did not change since,
``launcher/rank/datasets.py`` check_files).

Why not through ``megatron.core.datasets.indexed_dataset``: importing megatron.core pulls in torch and most of
Megatron (~3.5 s and ~450 MB per call, measured), which the login-node commands must not pay, and Megatron's
reader would mmap and validate the whole index while we need a few header fields. Writing stays with Megatron's
builder. The layout is Megatron's documented one (little-endian): magic ``MMIDIDX\\x00\\x00``, u64 version
(1), u8 dtype code, u64 sequence count N, u64 document count D (+1), then int32 lengths[N], int64 pointers[N],
int64 document indices[D]. Numpy and the standard library only.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
"""Megatron's DType codes (megatron.core.datasets.indexed_dataset.DType)."""


@dataclass
class IndexHeader:
    version: int
    dtype_code: int
    sequence_count: int
    document_count: int
    tokens: int  # sum of sequence lengths

    @property
    def dtype(self):
        return np.dtype(DTYPES[self.dtype_code])


def read_index_header(idx_path: str) -> IndexHeader:
    """Header and total token count of a Megatron .idx; raises ValueError with the reason when unreadable."""
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(34)
        if len(head) < 34 or head[:9] != MAGIC:
            raise ValueError("not a Megatron index (bad magic or shorter than the 34-byte header)")
        (version,) = struct.unpack("<Q", head[9:17])
        code = head[17]
        n, d = struct.unpack("<QQ", head[18:34])
    if version != 1:
        raise ValueError(f"index version {version}, expected 1")
    if code not in DTYPES:
        raise ValueError(f"unknown dtype code {code}")
    expected = 34 + 4 * n + 8 * n + 8 * d
    if size != expected:
        raise ValueError(f"index is {size} bytes, its header says {expected} (truncated or corrupt)")
    lengths = np.memmap(idx_path, dtype="<i4", mode="r", offset=34, shape=(n,)) if n else np.zeros(0, "<i4")
    tokens = int(lengths.sum(dtype=np.int64))
    return IndexHeader(version, code, n, d, tokens)


def bin_mismatch(prefix: str) -> str | None:
    """Why ``prefix.bin``/``.idx`` do not make a dataset (missing, unreadable index, a .bin of another size than
    the index describes), naming the file; None when they agree."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_):
        if not os.path.isfile(path):
            return f"{path} is missing"
    try:
        header = read_index_header(idx)
    except (ValueError, OSError) as exc:
        return f"{idx} is unreadable: {exc}"
    size, want = os.path.getsize(bin_), header.tokens * header.dtype.itemsize
    if size != want:
        return (f"{bin_} is {size:,} bytes but {os.path.basename(idx)} describes {header.tokens:,} "
                f"{header.dtype.name} tokens = {want:,} bytes")
    return None
