"""The tokenizer from a local ``tokenizer.json``: nothing is ever downloaded.

:func:`load_tokenizer` returns :class:`TextTokenizer`, the object the rank side hands to Megatron-Core
(``GPTDatasetConfig(tokenizer=...)``). Megatron's datasets read only ``vocab_size`` and ``eod`` (and ``pad``
when present: we define none, so GPTDataset uses its own pad sentinel, which never collides with a real id).
It follows the ``MegatronTokenizerBase`` interface (tokenize, detokenize, vocab, vocab_size,
apply_chat_template) by duck typing, so this module imports neither torch nor megatron (``tokenizers`` only).

The preprocessor (``data/corpus.py``) and ``export-hf`` (``launcher/hf/export.py``) load the tokenizer and find
its end-of-document id here too, so the ids the data files hold, the eod the ranks mask and the exported model's
eos are one rule. Only ``Tokenizer.from_str`` is used: it takes the file's contents, never a hub id, so a missing
file is a clear error rather than a download attempt.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, List, Optional, Sequence

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
