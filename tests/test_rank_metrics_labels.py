"""The utilisation label on the step line and in report/metrics.json says what it is measured against: on FP8
runs the MFU denominator stays the dense BF16 peak (as NVIDIA, Megatron-Bridge and the planner report it), and the
label says so; the step line stays parseable by tests/_rank_harness.py's STEP regex."""
from __future__ import annotations

import io
import json

from _rank_harness import STEP
from launcher.rank import metrics
from launcher.rank.console import Console
from launcher.schema import LoggingConfig

STEP_METRICS = {"step": 1, "loss": 2.5, "lr": 1e-4, "grad_norm": 0.5, "ms_per_step": 100.0, "tokens_per_s": 1e6,
                "tflops": 494.5, "mem_gib": 60.0}


def _logged_line(tmp_path, label: str, peak: float) -> tuple:
    out = io.StringIO()
    log = metrics.MetricsLogger(logging=LoggingConfig(tensorboard=False), bundle=tmp_path, run_name="x", config={},
                                rank=0, console=Console(0, out), peak_tflops=peak, util_label=label)
    log.step(dict(STEP_METRICS))
    return out.getvalue().strip(), log


def test_fp8_runs_say_mfu_is_against_the_bf16_peak(tmp_path):
    peak, label = metrics.utilisation_basis(peak_tflops_bf16=989.0, on_gpu=True, fp8="tensorwise")
    assert (peak, label) == (989.0, "MFU vs BF16 peak")
    assert metrics.utilisation_basis(peak_tflops_bf16=989.0, on_gpu=True, fp8=None) == (989.0, "MFU")
    line, log = _logged_line(tmp_path, label, peak)
    assert "| MFU vs BF16 peak 50.00% |" in line, line
    assert STEP.match(line) and float(STEP.match(line)[5]) == 494.5
    final = metrics.summary(log.history, log.evals, status="done", steps=1, world=8, flops_per_token=1.0,
                            peak_tflops=peak, util_label=label)
    log.close(final)
    report = json.loads((tmp_path / "report" / "metrics.json").read_text())["final"]
    assert report["mfu_basis"] == "MFU vs BF16 peak" and report["mfu_peak_tflops_per_rank"] == 989.0
