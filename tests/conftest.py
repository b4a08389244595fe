"""Shared test helpers: compose jobs, run the CLI in-process, and locate the repository."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RECIPES = sorted(p.stem for p in (ROOT / "recipes" / "recipe").glob("*.yaml"))


@pytest.fixture
def cli(capsys):
    """Run `python -m launcher ARGS` in-process; returns (exit code, stdout, stderr)."""
    from launcher.cli import main

    def run(*args: str):
        code = main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err
    return run
