"""``python -m launcher.rank --bundle DIR``: the rank wing's entry (what the rendered launch.sh starts)."""
import sys

from launcher.rank.entry import main

if __name__ == "__main__":
    sys.exit(main())
