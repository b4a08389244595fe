"""Each transformer layer's initialisation seed, by its global position: the same weights whatever the pipeline
layout (the decoder's layers in ``builder.py``, the MTP depths after them in ``mtp.py``)."""
from __future__ import annotations

LAYER_SEED_STRIDE = 1000003
"""A prime, so (seed, layer) pairs do not collide for realistic sizes."""


def layer_seed(seed: int, position: int) -> int:
    """The seed of the layer at global ``position`` (1-based: decoder layers 1..L, then MTP depth k at L + k)."""
    return seed * LAYER_SEED_STRIDE + position
