"""Login-node pre-flight checks of the training data, before any GPU is spent (``validate``, ``render``, ``run``
a row of ``launcher/preflight.py``'s table; the preprocessor's final step checks its shards with
``check_prefix``). Imports numpy and launcher code only: the ``.idx`` header is read by
``launcher/core/indexed_files.py`` (why not through Megatron: see there).
"""
from __future__ import annotations

import os
from typing import Any, List, Optional

import numpy as np

from launcher.core.blend import prefixes_and_weights
from launcher.core.paths import absolute
from launcher.core.indexed_files import read_index_header
from launcher import ROOT
from launcher.problems import Problem

SHIPPED = ROOT / "data" / "assets"
"""The shipped corpus and tokenizer (absolute: a relative path means the directory the command runs in)."""
SCAN_LIMIT_BYTES = 2 << 30
"""Token files up to this size are scanned completely for the largest id; larger ones are sampled."""
SAMPLE_BLOCKS = 256
SAMPLE_BLOCK_BYTES = 4 << 20


def max_token_id(bin_path: str, dtype: np.dtype, *, scan_limit: Optional[int] = None) -> tuple[int, bool]:
    """(largest id, scanned completely?). Files above scan_limit are sampled: SAMPLE_BLOCKS evenly spaced blocks.

    A full scan reads the file once in 64 MiB slices (bounded memory; ~1-2 GB/s from page cache); past the limit
    (default SCAN_LIMIT_BYTES) a sample keeps the login-node command fast, and the report says it sampled.
    """
    scan_limit = SCAN_LIMIT_BYTES if scan_limit is None else scan_limit
    data = np.memmap(bin_path, dtype=dtype, mode="r")
    if data.size == 0:
        return -1, True
    step = max(1, (64 << 20) // dtype.itemsize)
    if data.nbytes <= scan_limit:
        return int(max(int(data[i:i + step].max()) for i in range(0, data.size, step))), True
    block = SAMPLE_BLOCK_BYTES // dtype.itemsize
    starts = np.linspace(0, data.size - block, SAMPLE_BLOCKS).astype(np.int64)
    return int(max(int(data[s:s + block].max()) for s in starts)), False


def _is_dataset(prefix: str) -> bool:
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


def meant_prefix(prefix: str, shown: str) -> Optional[tuple[str, str]]:
    """The dataset a missing prefix surely meant, (shown form, why), or None: the prefix with its ``.bin``/``.idx``
    suffix dropped (a prefix names both files), with Megatron-LM's ``_text_document`` suffix added
    (tools/preprocess_data.py writes ``{output_prefix}_text_document.bin``), or the one dataset in a directory."""
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix) and _is_dataset(prefix[:-len(suffix)]):
            return shown[:-len(suffix)], f"a prefix names both files: drop {suffix}"
    if _is_dataset(prefix + "_text_document"):
        return shown + "_text_document", "Megatron-LM's preprocess_data.py adds _text_document to --output-prefix"
    if os.path.isdir(prefix):
        found = sorted(n[:-4] for n in os.listdir(prefix) if n.endswith(".bin") and _is_dataset(
            os.path.join(prefix, n[:-4])))
        if len(found) == 1:
            return os.path.join(shown, found[0]), "a directory is not a prefix; it holds one dataset"
    return None


def check_prefix(field: str, prefix: str, shown: str, vocab_size: int, problems: List[Problem],
                 blend: Optional[list] = None) -> Optional[int]:
    """Problems of one dataset prefix; returns its token count when readable. ``blend``: the whole data.blend, for
    a hint that is the complete override when the prefix surely meant another (``meant_prefix``)."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    missing = [p for p in (idx, bin_) if not os.path.isfile(p)]
    if missing:
        rule = (f"dataset files missing: {', '.join(os.path.basename(m) for m in missing)} (expected {shown}.bin and "
                f"{shown}.idx)")
        hint = ("python -m data.preprocess --input corpus.jsonl --tokenizer tokenizer.json "
                f"--output-prefix {shown} --append-eod")
        meant = meant_prefix(prefix, shown)
        if meant is not None:
            items = [str(x) for x in (blend if blend is not None else [shown])]
            items = [meant[0] if x == shown else x for x in items]
            rule, hint = f"{rule}; {meant[1]}", "data.blend=[" + ",".join(items) + "]"
        problems.append(Problem(field, shown, rule, hint))
        return None
    try:
        header = read_index_header(idx)
    except (ValueError, OSError) as exc:
        problems.append(Problem(field, shown, f"unreadable index {os.path.basename(idx)}: {exc}",
                                "rebuild the dataset with python -m data.preprocess"))
        return None
    bin_size, want = os.path.getsize(bin_), header.tokens * header.dtype.itemsize
    if bin_size != want:
        problems.append(Problem(field, shown, f".bin is {bin_size:,} bytes but the index describes {header.tokens:,} "
                                f"{header.dtype.name} tokens = {want:,} bytes (truncated or from another run)",
                                "rebuild the dataset with python -m data.preprocess"))
        return None
    if header.tokens == 0:
        problems.append(Problem(field, shown, f"the dataset is empty ({header.sequence_count} documents, 0 tokens: "
                                "its input had no text)", "remove it from data.blend, or re-run python -m "
                                "data.preprocess on an input with documents"))
        return None
    if header.dtype.kind not in "iu":
        problems.append(Problem(field, shown, f"token dtype {header.dtype.name} is not an integer type",
                                "rebuild the dataset with python -m data.preprocess"))
        return header.tokens
    if np.iinfo(header.dtype).max < vocab_size - 1:
        # Megatron trains on it (the ids present are what the embedding must hold: the scan below), but its
        # preprocessors write uint16 only for a tokenizer under 65500 ids (indexed_dataset.DType.optimal_dtype):
        # the data came from a smaller vocabulary than the model's, a padded one or another tokenizer.
        problems.append(Problem(field, shown, f"token dtype {header.dtype.name} holds ids up to "
                                f"{np.iinfo(header.dtype).max} only: the data was tokenized with a vocabulary "
                                f"under 65500, the model has model.vocab_size={vocab_size}",
                                "nothing to do if the model's vocabulary extends the data's tokenizer; else "
                                "re-tokenize with the model's tokenizer", severity="warning"))
    top, complete = max_token_id(bin_, header.dtype)
    if top >= vocab_size:
        problems.append(Problem(field, shown, f"largest token id {top} >= model.vocab_size {vocab_size}"
                                + ("" if complete else " (found in a sample of the file)"),
                                f"model.vocab_size={top + 1} or larger, or re-tokenize with the model's tokenizer"))
    elif not complete:
        problems.append(Problem(field, shown, f"largest id checked on a sample only ({SAMPLE_BLOCKS} blocks of "
                                f"{SAMPLE_BLOCK_BYTES >> 20} MiB; the file is over {SCAN_LIMIT_BYTES >> 30} GiB); "
                                f"sampled max {top} < vocab_size {vocab_size}", "nothing to do if the tokenizer "
                                "matches the model", severity="warning"))
    return header.tokens


def _check_weights(weights: List[float], problems: List[Problem]) -> None:
    bad = [w for w in weights if not w > 0]
    if bad:
        problems.append(Problem("data.blend", weights, f"every blend weight must be > 0 (got {bad})",
                                "remove the dataset from the blend, or give it a positive weight"))
        return
    total = sum(weights)
    if abs(total - 1.0) > 1e-6:
        norm = [round(w / total, 6) for w in weights]
        problems.append(Problem("data.blend", weights, f"weights sum to {total:g}; they are normalised to {norm}",
                                f"weights {norm} to silence this", severity="warning"))


def preflight(data: Any, *, vocab_size: int, tokens_needed: int) -> List[Problem]:
    """Every problem with the data section found without importing torch or megatron."""
    if data.kind == "mock":
        return []
    problems: List[Problem] = []
    try:
        prefixes, weights = prefixes_and_weights(data.blend)
    except ValueError as exc:
        return [Problem("data.blend", list(data.blend), str(exc), "data.blend=[0.3,path/a,0.7,path/b]")]
    if not prefixes:
        return [Problem("data.blend", [], "no dataset prefixes", f"data.blend=[{SHIPPED}/smoke_text_document] or data.kind=mock")]
    if data.tokenizer:  # what the ranks hand to tokenizers.Tokenizer.from_str, checked here (no torch, no tokenizers)
        from launcher.core.tokenizer_file import tokenizer_file_problem

        bad = tokenizer_file_problem(absolute(data.tokenizer))
        if bad is not None:
            problems.append(Problem("data.tokenizer", data.tokenizer, bad[0],
                                    f"data.tokenizer={bad[1] or f'{SHIPPED}/tokenizer.json'}"))
    if weights is not None:
        _check_weights(weights, problems)
    counts = []
    for i, shown in enumerate(prefixes):
        field = f"data.blend[{2 * i + 1 if weights is not None else i}]"
        counts.append(check_prefix(field, absolute(shown), shown, vocab_size, problems, list(data.blend)))
    if any(c is None for c in counts) or tokens_needed <= 0:
        return problems
    _check_epochs(data, prefixes, weights, counts, tokens_needed, problems)
    return problems


def _train_fraction(split: str) -> float:
    parts = [float(x) for x in str(split).replace("/", ",").split(",") if x.strip()]
    parts += [0.0] * (3 - len(parts))
    return parts[0] / sum(parts) if sum(parts) > 0 else 1.0


def _check_epochs(data, prefixes, weights, counts, tokens_needed, problems) -> None:
    """Tokens available for training vs tokens the run consumes; the worst dataset's epochs under its weight."""
    frac = _train_fraction(data.split)
    w = weights if weights is not None else [c / sum(counts) for c in counts]
    total_w = sum(w)
    if total_w <= 0:
        return
    epochs = [tokens_needed * (wi / total_w) / max(c * frac, 1) for wi, c in zip(w, counts)]
    worst = max(range(len(epochs)), key=epochs.__getitem__)
    available = int(sum(counts) * frac)
    if epochs[worst] > 1.0:
        problems.append(Problem(
            "data.blend", prefixes[worst],
            f"training needs {tokens_needed:,} tokens; {available:,} training tokens are available "
            f"(split {data.split!r}), so {prefixes[worst]} is repeated {epochs[worst]:.2f} epochs",
            "add data, lower train.train_steps/train_tokens, or accept repetition", severity="warning"))
