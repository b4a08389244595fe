"""Parse ``data.blend`` into prefixes and weights. Pure Python: used on the login node and on ranks. (Relative
paths: ``launcher.core.paths``.)"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

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

