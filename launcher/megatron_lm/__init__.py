"""Megatron-LM users at home: their argument names as hints, their launch scripts imported, our jobs exported.

- ``table``: the Megatron-LM argument table (and Megatron-Core config names, from ``launcher.core.wiring``); the
  front door's hints for Megatron-LM flags and names (``cli_flag_hint``, ``hint_for``) read it.
- ``translate``: arguments -> our fields (import) and a job -> arguments (export), from that table.
- ``importer``: runs a launch script with recording stand-ins, writes the recipe (and a model entry when no
  existing one has the architecture), and checks that the recipe composes back to what was imported.
- ``export``: a job as a Megatron-LM ``pretrain_gpt.py`` launch.
- ``commands``: ``python -m launcher import ...`` and ``action=megatron-args``.

This face imports nothing: a command or a hint loads only the module it needs.
Login-node code: no torch, no megatron.
"""
