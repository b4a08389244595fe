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


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """``_rank_harness.train(...)`` once per distinct job in the whole session: the uninterrupted runs that the
    resume and reshard tests compare losses with (and load step checkpoints from, with checkpoint.load=, which
    reads them) are the same jobs, so each is trained once. Keyed by the composed config, not by the spelling
    of the overrides."""
    from _rank_harness import train
    from launcher.config import compose_job, job_to_yaml

    runs: dict = {}

    def get(nproc: int, overrides):
        key = job_to_yaml(compose_job([*overrides, f"cluster.gpus_per_node={nproc}"]))
        if key not in runs:
            runs[key] = train(tmp_path_factory.mktemp("reference"), "uninterrupted", nproc, overrides)
        return runs[key]
    return get
