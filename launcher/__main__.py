"""Entry point: python -m launcher [key=value ...] (see launcher/cli.py)."""
import sys

from launcher.cli import main

sys.exit(main())
