"""Parse ``data.blend`` and resolve dataset paths. Pure Python: used on the login node and on ranks."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

from launcher import ROOT
from launcher.core.blend import parse_blend as _blend_pairs


def parse_blend(blend: Sequence[Any]) -> Tuple[List[str], Optional[List[float]]]:
    """``[w, prefix, w, prefix, ...]`` → (prefixes, weights); ``[prefix, ...]`` → (prefixes, None).

    The rules are ``launcher.core.blend.parse_blend``'s (one parser for validation and use). Raises ValueError
    with a message naming the rule when the list mixes the two forms.
    """
    items = list(blend)
    try:
        pairs = _blend_pairs(items)
    except ValueError:
        raise ValueError("blend must be [prefix, ...] or [weight, prefix, weight, prefix, ...]") from None
    weighted = len(pairs) != len(items)  # the weighted form has two items per pair, the plain form one
    return [p for _, p in pairs], ([w for w, _ in pairs] if weighted else None)


def resolve_path(path: str) -> str:
    """Absolute path of a dataset prefix or file; relative ones are taken from the repository root."""
    p = Path(os.path.expanduser(path))
    return str(p if p.is_absolute() else ROOT / p)
