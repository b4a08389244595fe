"""Tokenise JSONL text into a Megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), fast and streaming.

    python -m data.preprocess --input corpus.jsonl[.gz|.zst] [more files or 'shards/**/*.jsonl'] \\
        --tokenizer tokenizer.json --output-prefix out/corpus --workers 2 --append-eod [--json-key text]

With ``--slurm`` the same command tokenises a large corpus as a Slurm job array over byte-sized shards, with a
manifest, resubmission of unfinished shards only, and a final check writing a token-weighted blend (see
``data/slurm_array.py``).

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
* Output goes to ``PREFIX.bin.partial-PID-START-HOST``/``PREFIX.idx.partial-...`` (the writer holds an flock on
  the ``.bin`` partial; see ``_remove_stale_partials``) and is renamed into place only after the
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
    return paths


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


def _on_sigterm(signum, frame):  # turn SIGTERM into an exception so the partial files are removed
    raise SystemExit(128 + signum)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m data.preprocess", description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", help="JSONL files (.jsonl, .jsonl.gz, .jsonl.zst) or globs ('**' recurses)")
    ap.add_argument("--tokenizer", help="local tokenizer.json (nothing is downloaded)")
    ap.add_argument("--output-prefix", help="writes PREFIX.bin and PREFIX.idx (with --slurm: PREFIX-NNNNN-of-NNNNN.*)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer threads")
    ap.add_argument("--append-eod", action="store_true", help="append the end-of-document id after each document")
    ap.add_argument("--json-key", default="text", help="the JSON field holding the text")
    ap.add_argument("--eod-token", default=None, help="end-of-document token (default <|endoftext|> or similar)")
    ap.add_argument("--chunk-mb", type=float, default=4, help="input block size; memory is a few blocks")
    ap.add_argument("--backend", default="auto", choices=["auto", "gigatoken", "tokenizers"])
    ap.add_argument("--cache-budget-mb", type=int, default=256,
                    help="rebuild gigatoken's encode cache when memory grows past this (bounds peak RSS)")
    ap.add_argument("--quiet", action="store_true")
    sl = ap.add_argument_group("cluster (a Slurm job array over shards; see data/slurm_array.py)")
    sl.add_argument("--slurm", action="store_true", help="plan shards, render and submit the array and its final check")
    sl.add_argument("--render-only", action="store_true",
                    help="with --slurm: write manifest and scripts, submit nothing")
    sl.add_argument("--shard-size-mb", type=float, default=4096, help="input bytes (on disk) per array task")
    sl.add_argument("--retries", type=int, default=2, help="attempts after the first for a failed task")
    sl.add_argument("--max-parallel", type=int, default=0, help="array tasks running at once (0: no limit)")
    sl.add_argument("--time", default="04:00:00", help="time limit per task")
    sl.add_argument("--partition", default=None)
    sl.add_argument("--account", default=None)
    sl.add_argument("--mem", default=None, help="memory per task, e.g. 8G")
    sl.add_argument("--cpus-per-task", type=int, default=None, help="default: --workers")
    sl.add_argument("--job-name", default="preprocess")
    sl.add_argument("--python", default=None, help="interpreter on the compute nodes (default: this one)")
    sl.add_argument("--workdir", default=None, help="checkout on the compute nodes (default: this one)")
    sl.add_argument("--container-image", default=None, help="run tasks in this image (pyxis)")
    sl.add_argument("--container-mounts", default="", help="SRC:DST,...; must cover inputs, outputs, tokenizer")
    sl.add_argument("--secret-env", action="append", default=[], help="environment variable passed by name")
    sl.add_argument("--sbatch-arg", action="append", default=[], dest="sbatch_args", help="extra #SBATCH line")
    sl.add_argument("--manifest", default=None, help="(array tasks) the manifest written by --slurm")
    sl.add_argument("--task-index", type=int, default=None, help="(array tasks) default $SLURM_ARRAY_TASK_ID")
    sl.add_argument("--finalize", action="store_true", help="(final step) check all shards and write the blend")
    return ap


def _submit(args, argv) -> int:
    from data import slurm_array

    settings = {"tokenizer": args.tokenizer, "append_eod": args.append_eod, "json_key": args.json_key,
                "eod_token": args.eod_token, "chunk_mb": args.chunk_mb, "backend": args.backend,
                "cache_budget_mb": args.cache_budget_mb, "workers": args.workers}
    if not os.path.isfile(args.tokenizer):
        raise SystemExit(f"error: --tokenizer {args.tokenizer!r}: no such file (nothing is downloaded)")
    opts = {k: getattr(args, k) for k in ("retries", "max_parallel", "time", "partition", "account", "mem",
                                           "cpus_per_task", "job_name", "python", "workdir", "container_image",
                                           "container_mounts", "secret_env", "sbatch_args")}
    out = slurm_array.submit(expand_inputs(args.input), args.output_prefix, settings, opts,
                             shard_bytes=max(1, int(args.shard_size_mb * 2**20)), render_only=args.render_only,
                             argv=list(argv if argv is not None else sys.argv[1:]))
    done = out["shards"] - len(out["pending"])
    print(f"manifest {out['manifest']}: {out['shards']} shards, {done} already complete")
    print(f"scripts {out['array_script']} and {out['finalize_script']}")
    if args.render_only:
        for cmd in out["commands"]:
            print("would run:", " ".join(c for c in cmd if c))
    else:
        if out["array_job"]:
            print(f"submitted: array job {out['array_job']} ({len(out['pending'])} tasks)")
        print(f"submitted: final check job {out['final_job']}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if args.manifest:
        from data import slurm_array

        if args.finalize:
            return slurm_array.finalize(args.manifest)
        return slurm_array.run_task(args.manifest, args.task_index, light_import=True)
    missing = [o for o in ("input", "tokenizer", "output_prefix") if not getattr(args, o)]
    if missing:
        ap.error("the following arguments are required: " + ", ".join("--" + m.replace("_", "-") for m in missing))
    if args.slurm:
        return _submit(args, argv)
    unwritable = _writable_prefix(args.output_prefix)
    if unwritable:
        print(f"error: {unwritable}", file=sys.stderr)
        return 2
    try:
        s = preprocess(args.input, args.tokenizer, args.output_prefix, workers=args.workers,
                       append_eod=args.append_eod, json_key=args.json_key, chunk_mb=args.chunk_mb,
                       backend=args.backend, eod_token=args.eod_token, cache_budget_mb=args.cache_budget_mb,
                       quiet=args.quiet, light_import=True)
    except EmptyInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the disk filled up or went away mid-run: one line naming the file
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        print(f"error: --output-prefix {args.output_prefix}: {exc.strerror or exc}{where}; no dataset was written",
              file=sys.stderr)
        return 1
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
