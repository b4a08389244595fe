"""``data.blend`` parsing: one parser for validation and the data pre-flight (login node) and dataset building
(ranks). Relative prefixes: ``launcher/core/paths.py``."""
from __future__ import annotations


def is_number(x) -> bool:
    """True for ints/floats and numeric strings (a blend weight), False for booleans and paths."""
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, float)):
        return True
    try:
        float(str(x))
        return True
    except ValueError:
        return False


def parse_blend(blend: list) -> list[tuple[float, str]]:
    """[w, p, w, p] or [p, p] -> [(weight, prefix)]; raises ValueError on a malformed list."""
    if all(isinstance(x, str) and not is_number(x) for x in blend):
        return [(1.0, str(x)) for x in blend]
    if len(blend) % 2:
        raise ValueError("odd length")
    pairs = []
    for weight, prefix in zip(blend[0::2], blend[1::2]):
        if not is_number(weight) or is_number(prefix):
            raise ValueError("expected weight, prefix pairs")
        pairs.append((float(weight), str(prefix)))
    return pairs


def prefixes_and_weights(blend) -> tuple[list[str], list[float] | None]:
    """``[w, prefix, w, prefix, ...]`` -> (prefixes, weights); ``[prefix, ...]`` -> (prefixes, None): Megatron's
    blend argument. Raises ValueError naming the rule when the list mixes the two forms."""
    items = list(blend)
    try:
        pairs = parse_blend(items)
    except ValueError:
        raise ValueError("blend must be [prefix, ...] or [weight, prefix, weight, prefix, ...]") from None
    weighted = len(pairs) != len(items)  # the weighted form has two items per pair, the plain form one
    return [p for _, p in pairs], ([w for w, _ in pairs] if weighted else None)
