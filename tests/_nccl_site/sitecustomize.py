"""Test support: on PYTHONPATH for ranks run under the NCCL emulation (tests/_nccl_emulation.py)."""
import os
import sys

if os.environ.get("LAUNCHER_NCCL_EMULATION"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import _nccl_emulation

    _nccl_emulation.install()
