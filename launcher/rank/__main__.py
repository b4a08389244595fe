"""``python -m launcher.rank --bundle DIR``: the rank wing's entry (what the rendered launch.sh starts)."""
import sys

from launcher.rank.entry import main

if __name__ == "__main__":
    # before anything imports megatron.core: its ~40 import-time torch.compile decorations would otherwise
    # import TorchInductor on every rank (about 2.5 CPU s each; models/lazy_compile.py says why this is safe)
    from models.lazy_compile import defer_torch_compile

    defer_torch_compile()
    sys.exit(main())
