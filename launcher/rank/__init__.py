"""The rank wing: what runs on every rank under torchrun (``python -m launcher.rank``).

It imports torch and megatron.core, and of the launcher only ``launcher.schema`` and ``launcher.core`` (plus
``models``; the datasets and the tokenizer are ``datasets.py`` and ``tokenizer.py`` here) -- never the login-node
modules (validate, plan, render, actions, cli, executor) nor the preprocessor's ``data`` package;
``tests/test_layering.py`` checks both directions statically.
"""
