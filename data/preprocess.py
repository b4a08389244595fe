"""Tokenise JSONL text into a Megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), fast and streaming.

    python -m data.preprocess --input corpus.jsonl[.gz] [more files or 'shards/*.jsonl'] \\
        --tokenizer tokenizer.json --output-prefix out/corpus --workers 2 --append-eod [--json-key text]

Output is written at exactly ``--output-prefix`` (``out/corpus.bin``/``.idx``), and is byte-identical to what
Megatron-LM's ``tools/preprocess_data.py`` writes for the same tokenizer.json (ids of
``tokenizers.Tokenizer.encode(text, add_special_tokens=False)``; with ``--append-eod`` the eod id after every
non-empty document; an empty document is kept as an empty document entry).

How it is fast and bounded (see benchmarks/preprocess_bench.py for numbers):

* three stages joined by small bounded queues, so memory is O(chunk size), whatever the input size:
  read+parse thread (raw blocks of ``--chunk-mb`` split at newlines, orjson when installed) → encode (gigatoken's
  Rust BPE over the whole block on its own threads) → write thread (EOD insertion vectorised in numpy, one
  write per block). Not constant: the index lists Megatron's builder keeps (about 40 bytes per document), and
  gigatoken's encode cache, which is rebuilt whenever it grows past ``--cache-budget-mb`` (default 256).
* ``megatron.core`` (a few seconds to import) is imported in the writer thread while the first block is
  parsed and encoded.
* Output goes to ``PREFIX.bin.partial-PID``/``PREFIX.idx.partial-PID`` and is renamed into place only after the
  index is complete (old ``.idx`` removed first, ``.bin`` renamed, then ``.idx``): an interrupted run never
  leaves a pair at the final prefix that looks valid.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

_STOP = object()


def expand_inputs(patterns: List[str]) -> List[str]:
    """Each argument is a file or a glob; globs expand sorted. Missing inputs are an error."""
    paths: List[str] = []
    for pat in patterns:
        hits = sorted(glob.glob(pat)) if glob.has_magic(pat) else ([pat] if os.path.exists(pat) else [])
        if not hits:
            raise SystemExit(f"error: --input {pat!r}: no such file; give a JSONL file, .jsonl.gz, or a glob")
        paths.extend(hits)
    return paths


def _json_loads():
    try:
        import orjson

        return orjson.loads
    except ImportError:  # pragma: no cover - orjson is optional
        import json

        return json.loads


def iter_blocks(paths: List[str], chunk_bytes: int) -> Iterator[Tuple[bytes, int, str]]:
    """Blocks of whole lines, about chunk_bytes each; yields (block, raw bytes consumed so far, path)."""
    done_before = 0
    for path in paths:
        with open(path, "rb") as raw:
            f = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
            tail = b""
            while True:
                data = f.read(chunk_bytes)
                if not data:
                    break
                data = tail + data
                cut = data.rfind(b"\n") + 1
                if cut == 0:  # one line longer than the chunk: keep reading
                    tail = data
                    continue
                tail = data[cut:]
                yield data[:cut], done_before + raw.tell(), path
            if tail:
                yield tail, done_before + raw.tell(), path
            done_before += os.path.getsize(path)


def parse_block(block: bytes, key: str, loads, path: str) -> List[str]:
    """The text field of every non-blank line."""
    texts = []
    for line in block.split(b"\n"):
        if not line.strip():
            continue
        try:
            value = loads(line)[key]
        except KeyError:
            raise SystemExit(f"error: {path}: a line has no {key!r} field; choose the field with --json-key") from None
        except ValueError as exc:
            raise SystemExit(f"error: {path}: invalid JSON line ({exc}): {line[:80]!r}") from None
        if not isinstance(value, str):
            raise SystemExit(f"error: {path}: field {key!r} must be a string, got {type(value).__name__}")
        texts.append(value)
    return texts


def import_indexed_dataset(light: bool = False):
    """Megatron-Core's indexed_dataset module (the builder and its DType).

    ``import megatron.core`` runs the package ``__init__``, which imports nearly all of Megatron-Core
    (transformer, tensor_parallel, fusions, inductor, ...): 3.7 s of a 5.8 s run on 100 MB here. With
    ``light=True`` — only for this command's own process, where nothing else will use megatron — the two
    parent packages are registered as plain namespace packages so that only indexed_dataset and what it
    imports itself are loaded (1.6 s). Any failure falls back to the normal import.
    """
    if light and "megatron.core" not in sys.modules:
        import importlib.util
        import types

        try:
            spec = importlib.util.find_spec("megatron")
            root = list(spec.submodule_search_locations)[0]
            for name in ("megatron.core", "megatron.core.datasets"):
                pkg = types.ModuleType(name)
                pkg.__path__ = [os.path.join(root, *name.split(".")[1:])]
                pkg.__package__ = name
                sys.modules[name] = pkg
            import megatron.core.parallel_state  # noqa: F401  (breaks the utils <-> parallel_state cycle)
            from megatron.core.datasets import indexed_dataset

            return indexed_dataset
        except Exception:
            for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
                del sys.modules[name]
    from megatron.core.datasets import indexed_dataset

    return indexed_dataset


class _Writer(threading.Thread):
    """Owns the IndexedDatasetBuilder; imports megatron.core itself so the import overlaps encoding."""

    def __init__(self, bin_path: str, vocab_size: int, eod: Optional[int], light_import: bool = False):
        super().__init__(daemon=True, name="writer")
        self.light_import = light_import
        self.q: "queue.Queue" = queue.Queue(maxsize=1)
        self.bin_path, self.vocab_size, self.eod = bin_path, vocab_size, eod
        self.builder = None
        self.ready = threading.Event()  # set once megatron is imported and the builder exists
        self.error: Optional[BaseException] = None

    def run(self):
        try:
            indexed_dataset = import_indexed_dataset(light=self.light_import)
            self.dtype = indexed_dataset.DType.optimal_dtype(self.vocab_size)
            self.builder = indexed_dataset.IndexedDatasetBuilder(self.bin_path, dtype=self.dtype)
            self.ready.set()
            while True:
                item = self.q.get()
                if item is _STOP:
                    return
                self.add_block(*item)
        except BaseException as exc:  # surfaced by the main thread
            self.error = exc
            while self.q.get() is not _STOP:  # unblock the producer
                pass

    def add_block(self, flat, lengths):
        """Append a block of documents; same bytes as add_document(doc_ids, [len]) per document."""
        import numpy as np

        nonempty = lengths > 0
        if self.eod is not None:
            out_lens = lengths + nonempty
            out = np.empty(int(out_lens.sum()), dtype=self.dtype)
            eod_pos = np.cumsum(out_lens)[nonempty] - 1
            keep = np.ones(out.size, dtype=bool)
            keep[eod_pos] = False
            out[keep] = flat
            out[eod_pos] = self.eod
        else:
            out_lens, out = lengths, flat.astype(self.dtype, copy=False)
        b = self.builder
        if getattr(b, "multimodal", False) or not hasattr(b, "document_indices"):
            start = 0  # unknown builder layout: the per-document public API
            for n in out_lens.tolist():
                b.add_document(out[start:start + n], [n] if n else [])
                start += n
            return
        # Bulk form of add_document: data to the .bin, lengths/boundaries to the builder's index lists.
        b.data_file.write(memoryview(np.ascontiguousarray(out)))
        base = len(b.sequence_lengths)
        b.sequence_lengths.extend(out_lens[nonempty].tolist())
        b.document_indices.extend((base + np.cumsum(nonempty)).tolist())


class _Progress:
    def __init__(self, total_bytes: int, every_s: float = 2.0):
        self.t0 = time.perf_counter()
        self.total, self.every, self.last = max(total_bytes, 1), every_s, 0.0
        self.docs = self.tokens = self.done = 0

    def update(self, docs: int, tokens: int, done_bytes: int, force: bool = False):
        self.docs += docs
        self.tokens += tokens
        self.done = done_bytes
        now = time.perf_counter() - self.t0
        if force or now - self.last >= self.every:
            self.last = now
            rate = self.done / max(now, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            sys.stderr.write(
                f"[preprocess] {self.docs:,} docs ({self.docs / max(now, 1e-9):,.0f} docs/s) "
                f"{self.tokens:,} tokens ({self.tokens / max(now, 1e-9) / 1e6:.2f} M tok/s) "
                f"{self.done / 2**20:,.0f}/{self.total / 2**20:,.0f} MiB input, ETA {eta:,.0f} s\n")
            sys.stderr.flush()


def _malloc_trim():
    """glibc's malloc_trim, or a no-op: returns freed heap pages of the per-thread arenas to the OS."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda pad: 0


def _partial_paths(prefix: str) -> Tuple[str, str]:
    return f"{prefix}.bin.partial-{os.getpid()}", f"{prefix}.idx.partial-{os.getpid()}"


def _remove_stale_partials(prefix: str) -> None:
    """Leftovers of a killed earlier run (its pid no longer alive)."""
    for p in glob.glob(glob.escape(prefix) + ".*.partial-*"):
        try:
            pid = int(p.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError):
            os.remove(p)
        except PermissionError:
            pass


def _publish(prefix: str, tmp_bin: str, tmp_idx: str) -> None:
    """Rename into place so that no moment shows a new .bin beside an old .idx (or vice versa)."""
    for path in (tmp_bin, tmp_idx):
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    if os.path.exists(prefix + ".idx"):
        os.remove(prefix + ".idx")
    os.replace(tmp_bin, prefix + ".bin")
    os.replace(tmp_idx, prefix + ".idx")


def preprocess(inputs: List[str], tokenizer: str, output_prefix: str, *, workers: int = 2, append_eod: bool = False,
               json_key: str = "text", chunk_mb: float = 4, backend: str = "auto", eod_token: Optional[str] = None,
               cache_budget_mb: int = 256, quiet: bool = False, light_import: bool = False) -> dict:
    """Tokenise the JSONL inputs into output_prefix.{bin,idx}; returns counts and timings."""
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, workers)))  # before any Rust thread pool exists
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    from data.tokenizer import batch_encoder, load_tokenizer

    paths = expand_inputs(inputs)
    tok = load_tokenizer(tokenizer, eod_token=eod_token)
    encoder = batch_encoder(tok.json, backend=backend, cache_budget_bytes=cache_budget_mb << 20)
    if hasattr(encoder, "rebase"):
        # Until the writer has imported megatron (~200 MB), growth is not cache; the writer's one-slot queue
        # stops encoding after a couple of blocks until then, so the unchecked part is bounded.
        encoder.rebase(armed=False)
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(output_prefix)
    tmp_bin, tmp_idx = _partial_paths(output_prefix)
    writer = _Writer(tmp_bin, tok.vocab_size, tok.eod if append_eod else None, light_import=light_import)
    writer.start()
    progress = _Progress(sum(os.path.getsize(p) for p in paths), every_s=float("inf") if quiet else 2.0)
    parsed: "queue.Queue" = queue.Queue(maxsize=1)
    reader_error: List[BaseException] = []

    def read_and_parse():
        loads = _json_loads()
        try:
            for block, done, path in iter_blocks(paths, max(1, int(chunk_mb * 2**20))):
                parsed.put((parse_block(block, json_key, loads, path), done))
        except BaseException as exc:
            reader_error.append(exc)
        finally:
            parsed.put(_STOP)

    reader = threading.Thread(target=read_and_parse, daemon=True, name="reader")
    ok = False
    try:
        reader.start()
        rebased, trim, blocks = False, _malloc_trim(), 0
        while True:
            item = parsed.get()
            if item is _STOP:
                break
            texts, done = item
            if not rebased and writer.ready.is_set() and hasattr(encoder, "rebase"):
                encoder.rebase()  # the writer's import of megatron is not encode cache
                rebased = True
            flat, lengths = encoder.encode(texts)
            if writer.error is not None:
                break
            writer.q.put((flat, lengths))
            blocks += 1
            if blocks % 8 == 0:
                # Blocks are freed by other threads than those that allocated them, and glibc's per-thread
                # arenas keep such pages: without this the 1 GB benchmark peaked at ~735 MB, with it ~675 MB.
                trim(0)
            progress.update(len(texts), int(lengths.sum()) + (int((lengths > 0).sum()) if append_eod else 0), done)
        writer.q.put(_STOP)
        writer.join()
        for err in reader_error + ([writer.error] if writer.error else []):
            raise err
        writer.builder.finalize(tmp_idx)
        _publish(output_prefix, tmp_bin, tmp_idx)
        ok = True
    finally:
        if not ok:
            if writer.is_alive():
                try:
                    writer.q.put_nowait(_STOP)
                except queue.Full:
                    pass
            for p in (tmp_bin, tmp_idx):
                if os.path.exists(p):
                    os.remove(p)
    progress.update(0, 0, progress.total, force=not quiet)
    elapsed = time.perf_counter() - progress.t0
    return {"documents": progress.docs, "tokens": progress.tokens, "seconds": elapsed, "backend": encoder.name,
            "cache_rebuilds": getattr(encoder, "rebuilds", 0),
            "bin": output_prefix + ".bin", "idx": output_prefix + ".idx"}


def _on_sigterm(signum, frame):  # turn SIGTERM into an exception so the partial files are removed
    raise SystemExit(128 + signum)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.preprocess", description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", required=True, help="JSONL files (.jsonl or .jsonl.gz) or globs")
    ap.add_argument("--tokenizer", required=True, help="local tokenizer.json (nothing is downloaded)")
    ap.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer threads")
    ap.add_argument("--append-eod", action="store_true", help="append the end-of-document id after each document")
    ap.add_argument("--json-key", default="text", help="the JSON field holding the text")
    ap.add_argument("--eod-token", default=None, help="end-of-document token (default <|endoftext|> or similar)")
    ap.add_argument("--chunk-mb", type=float, default=4, help="input block size; memory is a few blocks")
    ap.add_argument("--backend", default="auto", choices=["auto", "gigatoken", "tokenizers"])
    ap.add_argument("--cache-budget-mb", type=int, default=256,
                    help="rebuild gigatoken's encode cache when memory grows past this (bounds peak RSS)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    s = preprocess(args.input, args.tokenizer, args.output_prefix, workers=args.workers,
                   append_eod=args.append_eod, json_key=args.json_key, chunk_mb=args.chunk_mb,
                   backend=args.backend, eod_token=args.eod_token, cache_budget_mb=args.cache_budget_mb,
                   quiet=args.quiet, light_import=True)
    print(f"wrote {s['bin']} and {s['idx']}: {s['documents']:,} documents, {s['tokens']:,} tokens in "
          f"{s['seconds']:.1f} s ({s['tokens'] / max(s['seconds'], 1e-9) / 1e6:.2f} M tokens/s, {s['backend']}"
          + (f", encode cache rebuilt {s['cache_rebuilds']}x" if s["cache_rebuilds"] else "") + ")")
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is written, fsynced and renamed; skip interpreter teardown (torch's module finalisation
    # takes ~0.5 s, a sixth of a 100 MB run).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
