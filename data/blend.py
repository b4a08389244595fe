"""Parse ``data.blend`` and resolve dataset prefixes. Pure Python: used on the login node and on ranks."""
from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple


def repo_root() -> Path:
    """Relative dataset paths resolve against the launcher checkout (``launcher.ROOT``)."""
    try:
        from launcher import ROOT

        return Path(ROOT)
    except ImportError:  # pragma: no cover - data/ used without the launcher package
        return Path(__file__).resolve().parent.parent


def _is_weight(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def parse_blend(blend: Sequence[Any]) -> Tuple[List[str], Optional[List[float]]]:
    """``[w, prefix, w, prefix, ...]`` → (prefixes, weights); ``[prefix, ...]`` → (prefixes, None).

    Raises ValueError with a message naming the rule when the list mixes the two forms.
    """
    items = list(blend)
    if not items:
        return [], None
    if all(not _is_weight(x) for x in items):
        return [str(x) for x in items], None
    if len(items) % 2 == 0 and all(_is_weight(w) for w in items[0::2]) and not any(_is_weight(p) for p in items[1::2]):
        return [str(p) for p in items[1::2]], [float(w) for w in items[0::2]]
    raise ValueError("blend must be [prefix, ...] or [weight, prefix, weight, prefix, ...]")


def resolve_prefix(prefix: str, root: Optional[Path] = None) -> str:
    """Absolute path of a dataset prefix; relative ones are taken from the repository root."""
    p = Path(os.path.expanduser(prefix))
    if not p.is_absolute():
        p = (root or repo_root()) / p
    return str(p)


def resolve_path(path: Optional[str], root: Optional[Path] = None) -> Optional[str]:
    return None if path is None else resolve_prefix(path, root)
