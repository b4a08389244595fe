"""The zero-bubble benchmarks run end to end (at a toy shape: their figures mean nothing there): their torchrun
workers build both schedules in the same ranks through the rank wing's own Loop, so a rank-side change can break
them while every other test passes (the stop-reason change did: ``reduce_report`` got ``False`` from the worker).
Durations are not checked; the figures' lines and the equal losses are."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.multirank
def test_zbv_bench_runs_both_schedules_and_prints_the_replay(capsys):
    """ZB-V vs Megatron's interleaved 1F1B, 4 ranks, with the per-stage calibration run first."""
    import zbv_bench

    assert zbv_bench.main(["--steps", "3", "--tiny", "--microbatches", "4"]) == 0  # costs: measured-stages
    out = capsys.readouterr().out
    costs = out.split("T_F,T_B,T_W = [")[1].split("]")[0].split(",")
    assert len(costs) == 6 * zbv_bench.P and max(float(c) for c in costs) == 1.0
    for line in ("zb_v / interleaved: idle fraction", "zb_v / interleaved, replayed: idle fraction",
                 "zb_v / interleaved, at median op costs: idle fraction", "losses equal (rel 1e-6): True"):
        assert line in out, out
    assert out.count("  rank ") == 2 * zbv_bench.P  # CPU ms per rank and chunk, calibration and measured run
    assert "4 microbatches of" in out


@pytest.mark.multirank
def test_zb_bench_runs_both_schedules_and_prints_the_closed_form(capsys):
    """ZB-H1 vs Megatron's 1F1B, 2 ranks."""
    import zb_bench

    assert zb_bench.main(["--steps", "3", "--tiny"]) == 0
    out = capsys.readouterr().out
    assert "zb_h1 / 1f1b: idle fraction" in out and "hidden 64, FFN 128" in out, out
    assert "losses equal (rel 1e-6): True" in out, out
