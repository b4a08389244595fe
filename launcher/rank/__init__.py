"""The rank wing: what runs on every rank under torchrun (``python -m launcher.rank``).

It imports torch and megatron.core, and of the launcher only ``launcher.schema`` and ``launcher.core`` (plus
``models`` and the rank parts of ``data``) -- never the login-node modules (validate, plan, render, actions,
cli, executor); ``tests/test_layering.py`` checks both directions statically.
"""
