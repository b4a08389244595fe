"""Entry point: python -m launcher [key=value ...] (see launcher/cli.py).

``export-hf`` / ``import-hf`` (and ``post``, which runs export-hf and evaluates) read and write torch_dist checkpoints and so import torch: they are a tool of their
own (launcher/hf), handed over here by module name, before the torch-free login CLI is imported. Nothing runs on
import (dist_checkpointing's save starts a helper process, which imports the main module again).
"""
import sys

if __name__ == "__main__":
    if sys.argv[1:2] in (["export-hf"], ["import-hf"]):
        import importlib

        sys.exit(importlib.import_module("launcher.hf").main(sys.argv[1:]))
    if sys.argv[1:2] == ["post"]:  # the steps after training (post.*): export-hf and evaluation, the same tool
        import importlib

        sys.exit(importlib.import_module("launcher.hf.post").main(sys.argv[2:]))

    from launcher.cli import main

    sys.exit(main())
