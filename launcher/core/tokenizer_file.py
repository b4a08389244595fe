"""Is a path a Hugging Face ``tokenizers`` JSON file? Checked on the login node and by the preprocessor before
anything loads it (standard library only: no torch, no ``tokenizers``).

What the ranks (``launcher/rank/tokenizer.py``) and the preprocessor (``data/corpus.py``) hand to
``tokenizers.Tokenizer.from_str``: a UTF-8 JSON object whose ``model`` object names the tokenizer type and holds
its vocabulary (the file ``Tokenizer.save`` writes: ``{"version", "truncation", "padding", "added_tokens",
"normalizer", "pre_tokenizer", "post_processor", "decoder", "model": {"type": "BPE", "vocab": ...}}``). Anything
else (a model's ``config.json``, a sentencepiece ``tokenizer.model``, a directory, text) fails there, after the
job has been queued; here it is one line with the file beside it that would work.
"""
from __future__ import annotations

import errno
import json
import os
from typing import Optional, Tuple

SNIFF_BYTES = 4096
"""Bytes read to tell a binary file (a NUL, or not UTF-8) before parsing anything."""


def tokenizer_file_problem(path: str) -> Optional[Tuple[str, Optional[str]]]:
    """(why ``path`` is not a tokenizers JSON file, a path that is one or None); None when it is one."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "it passes through a symbolic-link loop", None
        return "tokenizer file not found (nothing is downloaded)", _beside(path)
    if os.path.isdir(path):
        inside = os.path.join(path, "tokenizer.json")
        ok = os.path.isfile(inside) and _content_problem(inside) is None
        return ("a directory, not a tokenizer.json file", inside if ok else None)
    why = _content_problem(path)
    return None if why is None else (why, _beside(path))


def _beside(path: str) -> Optional[str]:
    """A valid tokenizer.json in the same directory as ``path`` (not ``path`` itself), or None."""
    other = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer.json")
    if os.path.abspath(path) == other or not os.path.isfile(other):
        return None
    return other if _content_problem(other) is None else None


def _content_problem(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
            if not head.strip():
                return "an empty file, not a tokenizers JSON file"
            if b"\0" in head:
                return "a binary file (a sentencepiece .model?), not a tokenizers JSON file"
            text = (head + fh.read()).decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8 text (a binary file?), not a tokenizers JSON file"
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    try:
        tree = json.loads(text)
    except (ValueError, RecursionError) as exc:
        where = f" (line {exc.lineno}, column {exc.colno}: {exc.msg})" if isinstance(exc, json.JSONDecodeError) else ""
        return f"not JSON{where}, so not a tokenizers JSON file"
    model = tree.get("model") if isinstance(tree, dict) else None
    if not isinstance(model, dict) or not ("vocab" in model or "type" in model):
        looks = " (it looks like a model's config.json)" if isinstance(tree, dict) and \
            ("architectures" in tree or "model_type" in tree) else ""
        return f"JSON, but not a tokenizers file: it has no \"model\" with a vocabulary{looks}"
    return None
