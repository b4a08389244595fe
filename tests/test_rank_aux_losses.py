"""MoE load-balancing / z-losses and MTP losses are logged the way Megatron-LM's training_log logs them
(Megatron-Core's own trackers, reduced across ranks, 1/num_microbatches): appended to the step line after the
fields tests/_rank_harness.py's STEP regex reads, and in report/metrics.json per step."""
from __future__ import annotations

import math
import re

from _rank_harness import STEP, TINY, layout, steps, train

MOE = [*TINY, "model.num_experts=4", "model.moe_aux_loss_coeff=0.01", "model.moe_router_load_balancing_type=aux_loss"]


def test_moe_load_balancing_loss_is_logged_on_a_tiny_ep2_run(tmp_path):
    run = train(tmp_path, "moe", 2, [*MOE, *layout(ep=2)])
    assert run.steps and steps(run.stdout)  # the step lines still parse
    for step, h in run.steps.items():
        value = h["load_balancing_loss"]
        # Megatron's tracker holds aux_loss / coeff: num_experts * sum_i f_i * P_i, which is 1 for perfectly
        # even routing (f_i = P_i = 1/E ... times top-k) and at most E x top-k; finite and positive
        assert math.isfinite(value) and 0.5 < value < 4 * 2, (step, value)
    lines = [line for line in run.stdout.splitlines() if STEP.match(line)]
    assert lines and all(re.search(r"\| load_balancing_loss \d+\.\d{4}$", line) for line in lines), lines[:2]
