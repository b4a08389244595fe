"""Entry point: python -m launcher [key=value ...] (see launcher/cli.py).

``export-hf`` / ``import-hf`` read and write torch_dist checkpoints and so import torch: they are a tool of their
own (launcher/hf), handed over here by module name, before the torch-free login CLI is imported. Nothing runs on
import (dist_checkpointing's save starts a helper process, which imports the main module again).
"""
import sys

if __name__ == "__main__":
    if sys.argv[1:2] in (["export-hf"], ["import-hf"]):
        import importlib

        sys.exit(importlib.import_module("launcher.hf").main(sys.argv[1:]))

    from launcher.cli import main

    sys.exit(main())
