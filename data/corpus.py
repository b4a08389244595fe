"""The preprocessor's engine: JSONL text -> a Megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``),
fast and streaming (``preprocess``). The command is ``python -m data.preprocess`` (``data/preprocess.py``); the
Slurm job array (``data/slurm_array.py``) runs this same engine per shard.

How it is fast and bounded (see benchmarks/preprocess_bench.py for numbers):

* three stages joined by small bounded queues, so memory is O(chunk size), whatever the input size:
  read+parse thread (raw blocks of ``--chunk-mb`` split at newlines, orjson when installed) → encode (gigatoken's
  Rust BPE over the whole block on its own threads) → write thread (EOD insertion vectorised in numpy, one
  write per block). Not constant: the index lists Megatron's builder keeps (about 40 bytes per document), and
  gigatoken's encode cache, which is rebuilt whenever it grows past ``--cache-budget-mb`` (default 256).
* ``megatron.core`` (a few seconds to import) is imported in the writer thread while the first block is
  parsed and encoded.
* Output goes to ``PREFIX.bin.partial-PID-START-HOST``/``PREFIX.idx.partial-...`` (the writer holds an flock on
  the ``.bin`` partial; see ``_remove_stale_partials``) and is renamed into place only after the
  index is complete (old ``.idx`` removed first, ``.bin`` renamed, then ``.idx``): an interrupted run never
  leaves a pair at the final prefix that looks valid.
"""
from __future__ import annotations

import glob
import gzip
import os
import queue
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

_STOP = object()


def expand_inputs(patterns: List[str]) -> List[str]:
    """Each argument is a file or a glob (``**`` matches any depth); globs expand sorted. Missing inputs, and
    ``.zst`` inputs without the ``zstandard`` module, are an error before any work starts."""
    paths: List[str] = []
    for pat in patterns:
        hits = sorted(p for p in glob.glob(pat, recursive=True) if os.path.isfile(p)) if glob.has_magic(pat) \
            else ([pat] if os.path.exists(pat) else [])
        if not hits:
            raise SystemExit(f"error: --input {pat!r}: no such file; give a JSONL file, .jsonl.gz, or a glob")
        paths.extend(hits)
    zst = [p for p in paths if p.endswith(ZSTD_SUFFIXES)]
    if zst and _zstandard() is None:
        raise SystemExit(f"error: --input {zst[0]!r}: .zst input needs the 'zstandard' module (pip install "
                         "zstandard), which is not installed; install it or recompress as .jsonl.gz")
    for path in paths:
        bad = _compression_problem(path)
        if bad:
            raise SystemExit(f"error: --input {path!r}: {bad}")
    return paths


COMPRESSED_MAGIC = {".gz": (b"\x1f\x8b", "gzip"), ".zst": (b"\x28\xb5\x2f\xfd", "zstandard"),
                    ".zstd": (b"\x28\xb5\x2f\xfd", "zstandard")}
"""The first bytes of each compressed format the suffix promises (RFC 1952 ID1 ID2; RFC 8878 frame magic)."""


def _compression_problem(path: str) -> Optional[str]:
    """Why ``path`` is not what its suffix says (a plain JSONL named .gz would be read as gzip and fail mid-run with
    "Not a gzipped file", blamed on the output), or None. An empty file has no frame to check."""
    suffix = next((s for s in COMPRESSED_MAGIC if path.endswith(s)), None)
    if suffix is None:
        return None
    magic, name = COMPRESSED_MAGIC[suffix]
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(magic))
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if not head or head == magic:
        return None
    plain = head[:1] in (b"{", b"[") or head[:1].isspace()
    what = "plain JSON text" if plain else f"starts with {head!r}"
    return (f"named {suffix} but not {name}-compressed ({what}); rename it without {suffix}" if plain else
            f"named {suffix} but not {name}-compressed ({what}); recompress it, or rename it without {suffix}")


ZSTD_SUFFIXES = (".zst", ".zstd")


def _zstandard():
    try:
        import zstandard

        return zstandard
    except ImportError:
        return None


def open_text_stream(raw, path: str):
    """A streaming binary reader over one input: gzip, zstandard (when installed) or the plain file."""
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)
    if path.endswith(ZSTD_SUFFIXES):
        zstandard = _zstandard()
        if zstandard is None:
            raise SystemExit(f"error: {path}: .zst input needs the 'zstandard' module (pip install zstandard)")
        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    return raw


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
            f = open_text_stream(raw, path)
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


def _proc_start(pid: int) -> Optional[str]:
    """Start time of a live process (clock ticks since boot, /proc/PID/stat field 22); None when the pid is
    free or belongs to a zombie (killed, not yet reaped: it writes nothing more)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces and parentheses
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _owner_token() -> str:
    """``PID-STARTTIME-HOST``: names this writer uniquely even after its pid is reused by another process."""
    pid = os.getpid()
    return f"{pid}-{_proc_start(pid) or 0}-{socket.gethostname()}"


def _partial_paths(prefix: str) -> Tuple[str, str]:
    token = _owner_token()
    return f"{prefix}.bin.partial-{token}", f"{prefix}.idx.partial-{token}"


def _lock_partial(path: str) -> Optional[int]:
    """Create ``path`` and hold an exclusive flock on it for this process's life (released by the kernel when
    the process dies, however it dies). None where the filesystem does not support flock."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _owner_alive(token: str) -> Optional[bool]:
    """Whether the writer named by a partial's token still runs on this host; None when that cannot be told
    from here (another host). Old-style tokens are a bare pid."""
    pid_s, _, rest = token.partition("-")
    start, _, host = rest.partition("-")
    if not pid_s.isdigit():
        return False
    if host and host != socket.gethostname():
        return None
    now = _proc_start(int(pid_s))
    return now is not None and (not start or start == "0" or now == start)


def _locked_by_someone(path: str) -> Optional[bool]:
    """True if another open file holds a flock on ``path``; None when flock is unsupported there."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)


def _remove_stale_partials(prefix: str) -> List[str]:
    """Remove the partial files of earlier writers that are gone; returns the removed paths.

    A writer holds a flock on its ``.bin`` partial for its whole life, and its files are named
    ``partial-PID-STARTTIME-HOST``. A partial is stale when nobody holds that lock and its writer (same pid
    *and* start time, not a zombie) no longer runs here: a pid reused by another process, or a SIGKILLed writer
    its parent has not reaped yet, no longer keeps old partials alive. Both tests are needed: the lock spans
    hosts on a shared filesystem, the pid test covers filesystems without flock and the instant between a
    writer creating its file and locking it.
    """
    removed = []
    by_token: dict = {}
    for p in glob.glob(glob.escape(prefix) + ".*.partial-*"):
        by_token.setdefault(p.rsplit(".partial-", 1)[1], []).append(p)
    for token, paths in by_token.items():
        locked = _locked_by_someone(f"{prefix}.bin.partial-{token}")
        alive = _owner_alive(token)
        if locked or alive or (locked is None and alive is None):
            continue
        for p in paths:
            try:
                os.remove(p)
                removed.append(p)
            except FileNotFoundError:
                pass
    return removed


def _publish(prefix: str, tmp_bin: str, tmp_idx: str) -> None:
    """Rename into place so that no moment shows a new .bin beside an old .idx (or vice versa)."""
    for path in (tmp_bin, tmp_idx):
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    if os.path.exists(prefix + ".idx"):
        os.remove(prefix + ".idx")
    os.replace(tmp_bin, prefix + ".bin")
    os.replace(tmp_idx, prefix + ".idx")


class EmptyInput(Exception):
    """The inputs hold no tokens: no dataset is written (a 0-document dataset only fails later, in training)."""


def _writable_prefix(output_prefix: str) -> Optional[str]:
    """Why ``output_prefix``'s directory cannot take the dataset (created if missing), or None."""
    import errno
    import tempfile

    if output_prefix.endswith(("/", os.sep)) or Path(output_prefix).name in ("", ".", ".."):
        # PREFIX.bin and PREFIX.idx: a prefix ending in a directory would write the hidden files DIR/.bin, DIR/.idx
        return (f"--output-prefix {output_prefix}: a prefix ends in a file name (the dataset is PREFIX.bin and "
                f"PREFIX.idx); try --output-prefix {os.path.join(output_prefix, 'corpus')}")
    parent = Path(output_prefix).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".preprocess-probe-"):
            pass
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            return f"--output-prefix {output_prefix}: no space left on device in {parent}"
        return (f"--output-prefix {output_prefix}: {parent} is not writable ({exc.strerror or exc}); choose a "
                "directory you can write to")
    return None


def preprocess(inputs: List[str], tokenizer: str, output_prefix: str, *, workers: int = 2, append_eod: bool = False,
               json_key: str = "text", chunk_mb: float = 4, backend: str = "auto", eod_token: Optional[str] = None,
               cache_budget_mb: int = 256, quiet: bool = False, light_import: bool = False,
               allow_empty: bool = False) -> dict:
    """Tokenise the JSONL inputs into output_prefix.{bin,idx}; returns counts and timings. Inputs without a
    token raise EmptyInput (nothing written) unless ``allow_empty`` (a Slurm array shard: its manifest counts it)."""
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, workers)))  # before any Rust thread pool exists
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    from data.encoders import batch_encoder
    from launcher.rank.tokenizer import load_tokenizer

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
    lock_fd = _lock_partial(tmp_bin)  # the builder reopens the same file; the lock stays with this fd
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
        if progress.tokens == 0 and not allow_empty:  # a dataset of no tokens: training would refuse it; nothing is published
            raise EmptyInput(f"--input {' '.join(inputs)}: no text in {len(paths)} file(s) ({progress.docs} "
                             f"document(s) under key {json_key!r}, 0 tokens); nothing was written to "
                             f"{output_prefix}.bin/.idx; check --input and --json-key")
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
        if lock_fd is not None:
            os.close(lock_fd)
    progress.update(0, 0, progress.total, force=not quiet)
    elapsed = time.perf_counter() - progress.t0
    return {"documents": progress.docs, "tokens": progress.tokens, "seconds": elapsed, "backend": encoder.name,
            "cache_rebuilds": getattr(encoder, "rebuilds", 0), "vocab_size": tok.vocab_size,
            "bin": output_prefix + ".bin", "idx": output_prefix + ".idx"}
