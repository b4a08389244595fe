"""``data.blend`` parsing: one parser for validation (login node) and dataset building (ranks)."""
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
