"""`make test` runs the rank and Slurm tests two at a time with ``--dist loadgroup``: the tests of one xdist group
(tests/conftest.py ``_xdist_group``) must land on one worker, or two workers train the same reference runs and both
start the one-node Slurm cluster. pytest 9 with pytest-xdist 3.8 silently ignored every group (pyproject.toml pins
pytest < 9 for it); this runs four tests of one group on two workers and checks they shared one."""
from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

PROBE = '''
import os
from _rank_harness import run_train  # the static reading marks these multirank: grouped by module


def _record(name):
    assert run_train  # named, not called
    with open(os.path.join(os.environ["PROBE_OUT"], name), "w") as fh:
        fh.write(os.environ.get("PYTEST_XDIST_WORKER", "none"))


def test_a(): _record("a")
def test_b(): _record("b")
def test_c(): _record("c")
def test_d(): _record("d")
'''


def test_one_group_runs_on_one_worker(tmp_path):
    # under tests/ (conftest.py must apply), named off pytest's test_*.py pattern: given on the command line it is
    # collected here, while another session collecting tests/ meanwhile (a second checkout's suite, a helper's lane)
    # does not pick it up and then miss it when it is gone
    probe = ROOT / "tests" / f"_zz_xdist_probe_{tmp_path.name}.py"
    probe.write_text(PROBE)
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p",
                               "no:cacheprovider", str(probe)], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env={**__import__("os").environ, "PROBE_OUT": str(tmp_path)})
    finally:
        probe.unlink()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers = {(tmp_path / name).read_text() for name in "abcd"}
    assert len(workers) == 1 and workers != {"none"}, workers
