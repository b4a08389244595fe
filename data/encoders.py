"""The preprocessor's fast batch encoders for a local ``tokenizer.json`` (a tool module: ``data/corpus.py``).

:func:`batch_encoder` returns gigatoken's Rust BPE when it is installed and can load the file, else Hugging Face
``tokenizers``' ``encode_batch``. Both give the ids of ``tokenizers.Tokenizer.encode(text,
add_special_tokens=False)``, i.e. what Megatron-LM's preprocessors write (``tools/preprocess_data.py`` encodes
each document with the HF tokenizer). The tokenizer itself and its end-of-document id come from
``launcher/rank/tokenizer.py``, the one the ranks load. gigatoken's ``Tokenizer.from_json`` takes the file's
contents, never a hub id.
"""
from __future__ import annotations

import os
from typing import Any, List, Tuple


class _HFBatchEncoder:
    """``tokenizers`` encode_batch (Rust, RAYON_NUM_THREADS threads); the portable fallback."""

    name = "tokenizers"

    def __init__(self, json_text: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_str(json_text)

    def encode(self, texts: List[str]) -> Tuple["Any", "Any"]:
        import numpy as np

        encs = self._tok.encode_batch_fast(texts, add_special_tokens=False) if hasattr(
            self._tok, "encode_batch_fast") else self._tok.encode_batch(texts, add_special_tokens=False)
        lengths = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))
        flat = np.fromiter((i for e in encs for i in e.ids), dtype=np.uint32, count=int(lengths.sum()))
        return flat, lengths


class _GigatokenBatchEncoder:
    """gigatoken's Rust byte-level BPE (exact Hugging Face ids; ~10-50 M tokens/s on 2 cores).

    gigatoken memoises pre-token → ids in a cache that is never evicted (it grows with the number of distinct
    words seen: ~10 MB per MB of random-word text measured here). To keep peak memory bounded on any input we
    rebuild the backend — dropping the cache — whenever resident memory has grown by more than
    ``cache_budget_bytes`` since start; on natural text the cache saturates well below the default budget.
    """

    name = "gigatoken"

    def __init__(self, json_text: str, cache_budget_bytes: int = 256 << 20):
        import gigatoken

        self._gt = gigatoken
        self._json = json_text.encode("utf-8")
        self._tok = gigatoken.Tokenizer.from_json(self._json)
        self._budget = cache_budget_bytes
        self._base_rss = _rss_bytes()
        self.rebuilds = 0

    def rebase(self, armed: bool = True) -> None:
        """Count the cache budget from now (call once the process's other one-off growth, e.g. imports, is
        done); ``armed=False`` suspends the check until the next rebase()."""
        self._base_rss = _rss_bytes() if armed else None

    def encode(self, texts: List[str]):
        import numpy as np

        out = self._tok.encode_batch(texts, parallel=True)
        layout = out.layout
        offsets = np.asarray(layout.offsets.data)
        flat = np.asarray(layout.content.data)[offsets[0]:offsets[-1]]
        lengths = np.diff(offsets)
        if self._base_rss is not None and _rss_bytes() - self._base_rss > self._budget:
            self._tok = None  # drop the old cache before building the new one
            self._tok = self._gt.Tokenizer.from_json(self._json)
            self.rebuilds += 1
            # New baseline: whatever else grew meanwhile (e.g. megatron imported by the writer) is not cache.
            self._base_rss = _rss_bytes() - int(flat.nbytes)
        return flat, lengths


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def batch_encoder(json_text: str, backend: str = "auto", cache_budget_bytes: int = 256 << 20):
    """The fastest available exact encoder: backend auto | gigatoken | tokenizers."""
    if backend in ("auto", "gigatoken"):
        try:
            return _GigatokenBatchEncoder(json_text, cache_budget_bytes)
        except Exception:  # not installed, or a tokenizer type gigatoken does not support
            if backend == "gigatoken":
                raise
    return _HFBatchEncoder(json_text)
