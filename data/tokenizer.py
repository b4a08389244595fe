"""Tokenizers from a local ``tokenizer.json``: nothing is ever downloaded.

* :func:`load_tokenizer` returns :class:`TextTokenizer`, the object the rank side hands to Megatron-Core
  (``GPTDatasetConfig(tokenizer=...)``). Megatron's datasets read only ``vocab_size`` and ``eod`` (and ``pad``
  when present: we define none, so GPTDataset uses its own pad sentinel, which never collides with a real id).
  It follows the ``MegatronTokenizerBase`` interface (tokenize, detokenize, vocab, vocab_size,
  apply_chat_template) by duck typing, so this module imports neither torch nor megatron.
* :func:`batch_encoder` returns the fast batch encoder that ``data.preprocess`` uses: gigatoken's Rust BPE when
  it is installed and can load the file, else Hugging Face ``tokenizers``' ``encode_batch``. Both give the ids of
  ``tokenizers.Tokenizer.encode(text, add_special_tokens=False)``, i.e. what Megatron-LM's preprocessors write.

Only ``Tokenizer.from_str``/``from_file`` and gigatoken's ``Tokenizer.from_json`` are used: these take the file's
contents, never a hub id, so a missing file is a clear error rather than a download attempt.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
"""Special tokens that mark the end of a document, tried in this order when no eod token is named."""


def _read_json_text(path: str | os.PathLike) -> str:
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {p} (a local tokenizer.json is required; nothing is downloaded)")
    return p.read_text(encoding="utf-8")


def find_eod_id(hf_tokenizer: Any, eod_token: Optional[str] = None) -> int:
    """Id of the end-of-document token: eod_token if given, else the first of EOD_CANDIDATES in the vocab."""
    names = (eod_token,) if eod_token else EOD_CANDIDATES
    for name in names:
        tid = hf_tokenizer.token_to_id(name)
        if tid is not None:
            return int(tid)
    raise ValueError(f"tokenizer has no end-of-document token among {list(names)}; pass --eod-token NAME")


class TextTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` in the shape Megatron-Core's datasets expect."""

    def __init__(self, path: str | os.PathLike, eod_token: Optional[str] = None):
        from tokenizers import Tokenizer

        self.path = str(path)
        self.library = "huggingface"
        self._json = _read_json_text(path)
        self._tok = Tokenizer.from_str(self._json)
        self._eod = find_eod_id(self._tok, eod_token)
        # Megatron hashes the dataset config (tokenizer included) into the cache file names: identify the
        # tokenizer by content, not by path, so a moved checkout still hits its caches.
        self.unique_identifiers = {
            "class": type(self).__name__,
            "sha256": hashlib.sha256(self._json.encode("utf-8")).hexdigest(),
            "eod": self._eod,
        }

    @property
    def hf(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def json(self) -> str:
        """The tokenizer.json text this was loaded from."""
        return self._json

    @property
    def vocab_size(self) -> int:
        """Number of ids including added/special tokens (what the model's embedding must cover)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        """End-of-document id, appended after every document by ``--append-eod``."""
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def vocab(self) -> dict:
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict:
        return {v: k for k, v in self.vocab.items()}

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(map(int, ids)), skip_special_tokens=False)

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("pretraining tokenizer: no chat template")


def load_tokenizer(path: str | os.PathLike, eod_token: Optional[str] = None) -> TextTokenizer:
    """Load a local tokenizer.json (or a directory holding one). Never touches the network."""
    return TextTokenizer(path, eod_token=eod_token)


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
