"""Defer ``torch.compile``'s set-up from decoration time to the first call, for the whole rank process.

Why: Megatron-Core decorates about 40 functions with ``torch.compile`` at import time
(``megatron/core/jit.py`` binds ``jit_fuser = torch.compile``; ``fusions/fused_bias_*.py``, ``activations.py``,
``transformer/moe/router.py``, ...). ``torch.compile(fn)`` resolves its backend when it is called, which imports
TorchInductor (``torch/_inductor/compile_fx.py`` -> ``select_algorithm.py``, compiling some 20 Jinja templates):
measured here, ``import megatron.core`` plus the GPT model and pipeline modules took 6.8-7.7 CPU s per process
with it and 4.3-4.7 s without (2-core CPU machine, torch 2.x CPU), on every rank of every run. Most of those
functions are never called (CPU: the bias/activation fusions are off; GPU: only the ones the config enables), and
the ones that are called compile on their first call either way: ``torch.compile`` compiles lazily, only its
backend lookup is eager. So wrapping the decoration to run at the first call changes when the backend is looked
up, not what runs.

Apply before anything imports ``megatron.core`` (``launcher/rank/entry.py`` does, first thing).
"""
from __future__ import annotations

import functools

_ORIGINAL = None


def defer_torch_compile() -> bool:
    """Install the deferring ``torch.compile`` (once per process). Returns True when this call installed it."""
    global _ORIGINAL
    import torch

    if _ORIGINAL is not None:
        return False
    _ORIGINAL = torch.compile
    torch.compile = _deferred_compile
    return True


def is_deferred() -> bool:
    return _ORIGINAL is not None


def _deferred_compile(model=None, **options):
    """``torch.compile`` with its signature: as a decorator factory (``model=None``) or on a function. A module
    (``torch.compile(module)`` returns an ``OptimizedModule``) and ``disable=True`` go straight to the original."""
    import torch

    if model is None:
        return lambda fn: _deferred_compile(fn, **options)
    if options.get("disable") or isinstance(model, torch.nn.Module) or not callable(model):
        return _ORIGINAL(model, **options)
    compiled = []

    @functools.wraps(model)
    def first_call_compiles(*args, **kwargs):
        if not compiled:
            compiled.append(_ORIGINAL(model, **options))
        return compiled[0](*args, **kwargs)

    first_call_compiles.__wrapped_for_compile__ = model  # what a test checks: the original function, not compiled
    return first_call_compiles
