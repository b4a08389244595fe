"""python -m launcher.hf export-hf|import-hf ... (the same as python -m launcher export-hf|import-hf)."""
import sys

from launcher.hf import main

if __name__ == "__main__":  # dist_checkpointing.save starts a helper process: nothing runs on import
    sys.exit(main())
