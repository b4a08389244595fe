"""The layout search returns exactly what it returned before its speed-ups (issue 22): the full candidate list
(overrides, predicted throughput, step time, bubble, peak memory, why) of two searches, one with zero-bubble
candidates among interleaved MoE layouts (Qwen3-30B-A3B on 16 H100s) and one dense with userbuffer TP overlap
(Llama3-70B). A planner change that moves a prediction on purpose regenerates them:
UPDATE_GOLDEN=1 pytest tests/test_search_golden.py"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from launcher.config import compose_job
from launcher.plan.search import search

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import planner_accuracy as pa  # noqa: E402

CASES = {"qwen3_30b_16xh100": (pa._overrides(pa.ROWS[6]), 20), "llama3_70b": (["recipe=llama3_70b"], 40)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_search_output_is_unchanged(case):
    args, top = CASES[case]
    got = [c.to_dict() for c in search(compose_job(args), top=top)]
    golden = ROOT / "tests" / "golden" / f"search_{case}.json"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(golden.read_text())
    assert [c["overrides"] for c in got] == [c["overrides"] for c in want]
    assert got == want  # every number as before, to the last bit (JSON keeps a float's shortest repr)
