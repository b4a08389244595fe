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

The engine (streaming, bounded memory, atomic publication) is ``data/corpus.py``; this module is the command.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import List, Optional

from data.corpus import (EmptyInput, _lock_partial, _locked_by_someone, _proc_start,  # noqa: F401  (the API)
                         _remove_stale_partials, _writable_prefix, expand_inputs, preprocess)


_OWN_PROCESS = __name__ == "__main__"
"""Run as ``python -m data.preprocess``: the light Megatron import (``data/corpus.py`` import_indexed_dataset) pays
off and harms nothing. Called in-process (``main([...])`` from another program or a test) it would leave
``megatron.core`` a bare namespace package there, breaking any later use of Megatron in that process."""


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


def _tokenizer_problem(path: str) -> Optional[str]:
    """Why ``--tokenizer`` is not a tokenizers JSON file (launcher/core/tokenizer_file.py, the rule validate
    applies to data.tokenizer), with the file that would do; None when it is one."""
    from launcher.core.tokenizer_file import tokenizer_file_problem

    found = tokenizer_file_problem(path)
    if found is None:
        return None
    why, other = found
    return f"--tokenizer {path}: {why}; try --tokenizer {other or 'PATH/tokenizer.json (a Hugging Face tokenizers file)'}"


def main(argv: Optional[List[str]] = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if args.manifest:
        from data import slurm_array

        if args.finalize:
            return slurm_array.finalize(args.manifest)
        return slurm_array.run_task(args.manifest, args.task_index, light_import=_OWN_PROCESS)
    missing = [o for o in ("input", "tokenizer", "output_prefix") if not getattr(args, o)]
    if missing:
        ap.error("the following arguments are required: " + ", ".join("--" + m.replace("_", "-") for m in missing))
    bad_tokenizer = _tokenizer_problem(args.tokenizer)
    if bad_tokenizer:
        print(f"error: {bad_tokenizer}", file=sys.stderr)
        return 2
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
                       quiet=args.quiet, light_import=_OWN_PROCESS)
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
