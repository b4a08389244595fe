"""Rebuild the shipped smoke assets: ``tokenizer.json`` and ``smoke_text_document.{bin,idx}``.

Source text: the reStructuredText sources of the Python 3.11 documentation as Debian ships them
(``apt-get install python3.11-doc`` → ``/usr/share/doc/python3.11/html/_sources/**/*.rst.txt``, PSF licence).
Nothing is downloaded. Every step is deterministic: files are read in sorted path order, the BPE trainer sees
them in that order, and the dataset is written in the same order, so a rerun on the same package version
reproduces the files byte for byte (``--check`` verifies that against the shipped copies).

Run from the repository root:  python -m data.assets.build_assets [--source DIR] [--check]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_SOURCE = Path("/usr/share/doc/python3.11/html/_sources")
VOCAB_SIZE = 8192
"""The smoke model's vocab_size (recipes/model/smoke); the tokenizer must match it exactly."""
EOD = "<|endoftext|>"
MAX_TEXT_BYTES = 12_000_000
"""Cap on the text read, keeping the shipped .bin (uint16 tokens) comfortably under ~8 MB."""


def source_documents(source: Path, max_bytes: int = MAX_TEXT_BYTES) -> list[str]:
    """One document per .rst.txt file, sorted by path, up to max_bytes of text in all."""
    files = sorted(p for p in source.rglob("*.rst.txt") if p.is_file())
    if not files:
        raise SystemExit(f"no *.rst.txt under {source}; install the Debian package: apt-get install python3.11-doc")
    docs, total = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        if not text:
            continue
        if total + len(text) > max_bytes:
            break
        docs.append(text)
        total += len(text)
    return docs


def train_tokenizer(docs: list[str]):
    """A byte-level BPE (GPT-2 style pre-tokenisation, no normaliser), vocab exactly VOCAB_SIZE, id 0 = EOD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"trained vocab is {tok.get_vocab_size()}, expected {VOCAB_SIZE}")
    return tok


def write_dataset(tok, docs: list[str], prefix: Path) -> int:
    """Encode each document (plus EOD) and write a Megatron indexed dataset at prefix; returns tokens written."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    eod = tok.token_to_id(EOD)
    dtype = DType.optimal_dtype(tok.get_vocab_size())
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    total = 0
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids = np.asarray(enc.ids + [eod], dtype=dtype)
        builder.add_document(ids, [ids.size])
        total += ids.size
    builder.finalize(str(prefix) + ".idx")
    return total


def build(source: Path, out_dir: Path) -> dict:
    docs = source_documents(source)
    tok = train_tokenizer(docs)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"), pretty=False)
    tokens = write_dataset(tok, docs, out_dir / "smoke_text_document")
    return {"documents": len(docs), "text_bytes": sum(len(d.encode()) for d in docs), "tokens": tokens}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="directory of *.rst.txt files")
    ap.add_argument("--out", type=Path, default=HERE, help="where to write the assets (default: beside this file)")
    ap.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare with the shipped files")
    args = ap.parse_args(argv)
    names = ["tokenizer.json", "smoke_text_document.bin", "smoke_text_document.idx"]
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            stats = build(args.source, Path(tmp))
            diff = [n for n in names if _sha(Path(tmp) / n) != _sha(args.out / n)]
        print(json.dumps(stats))
        print("identical" if not diff else f"differ: {diff}")
        return 1 if diff else 0
    stats = build(args.source, args.out)
    print(json.dumps(stats))
    for n in names:
        print(f"{n}  {(args.out / n).stat().st_size:>10,d} bytes  sha256 {_sha(args.out / n)[:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
