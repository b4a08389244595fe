"""Test support for the data tests: real text without the network, and a plain reference encoder."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, List, Optional

ASSETS = Path(__file__).resolve().parent.parent / "data" / "assets"
TOKENIZER = ASSETS / "tokenizer.json"
SMOKE_PREFIX = ASSETS / "smoke_text_document"

EDGE_CASES = [
    "",  # empty document: kept as an empty document entry, no EOD (as Megatron-LM's tool does)
    "   ",
    "a",
    "text with <|endoftext|> inside it, which the tokenizer maps to its special id",
    "unicode: é漢字🙂 ß Ω \u200b zero-width, tabs\tand\r\nCRLF",
    "\n\n\nleading newlines",
]


def real_texts(n_docs: int, *, repeat: int = 1) -> List[str]:
    """Real documents (the Python docs) decoded from the shipped smoke dataset; byte-level BPE is lossless."""
    import numpy as np
    from tokenizers import Tokenizer

    from launcher.core.indexed_files import read_index_header

    tok = Tokenizer.from_file(str(TOKENIZER))
    eod = tok.token_to_id("<|endoftext|>")
    header = read_index_header(str(SMOKE_PREFIX) + ".idx")
    n = min(n_docs, header.sequence_count)
    lengths = np.memmap(str(SMOKE_PREFIX) + ".idx", dtype="<i4", mode="r", offset=34, shape=(header.sequence_count,))
    data = np.memmap(str(SMOKE_PREFIX) + ".bin", dtype=header.dtype, mode="r")
    texts, start = [], 0
    for length in lengths[:n].tolist():
        ids = data[start:start + length].tolist()
        start += length
        if ids and ids[-1] == eod:
            ids = ids[:-1]
        texts.append(tok.decode(ids, skip_special_tokens=False))
    return texts * repeat


def write_jsonl(path: Path, texts: Iterable[str], key: str = "text") -> Path:
    import gzip

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t, "meta": {"n": len(t)}}, ensure_ascii=False) + "\n")
    return path


def reference_encode(texts: Iterable[str], tokenizer: Path, prefix: Path, *, append_eod: bool,
                     eod_token: str = "<|endoftext|>") -> None:
    """The straightforward way (what Megatron-LM's classic tool does): encode each document, add_document."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    eod: Optional[int] = tok.token_to_id(eod_token)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=DType.optimal_dtype(tok.get_vocab_size()))
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        lens = [len(ids)] if ids else []
        if ids and append_eod:
            ids.append(eod)
            lens[-1] += 1
        builder.add_document(ids, lens)
    builder.finalize(str(prefix) + ".idx")
