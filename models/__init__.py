"""Rank-side model construction (Megatron-Core GPTModel). Imports torch lazily: ``from models import
build_model`` loads torch and megatron.core only when called."""


def build_model(**kwargs):
    """See :func:`models.builder.build_model`."""
    from models.builder import build_model as _build

    return _build(**kwargs)
