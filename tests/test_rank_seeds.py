"""Pipeline stages start from different weights on the GPU init path (issue: every stage drew the same layer
weights from the same RNG tracker seed), with Megatron-LM's seed formula; the CPU init path stays
layout-independent (the parity tests rely on it)."""
from __future__ import annotations

import json

from _rank_harness import ROOT, TINY, layout, run_worker



def test_stage_seed_is_megatron_lms_formula():
    from launcher.rank.setup import stage_seed

    # megatron/training/initialize.py _set_random_seed: seed + 100 * pipeline rank (no DP term by default)
    assert [stage_seed(1234, r) for r in range(4)] == [1234, 1334, 1434, 1534]


def test_two_stages_draw_different_weights_on_the_gpu_init_path(tmp_path):
    """PP3: stages 1 and 2 hold neither the embedding nor anything else drawn before their first layer, so with
    one tracker seed for every stage their first layers would be the same draw (stage 0's differs anyway: it
    draws the embedding first)."""
    out = tmp_path / "out"
    proc = run_worker(ROOT / "tests" / "_seed_worker.py", [out, *TINY, *layout(pp=3), "model.num_layers=6",
                                                           "cluster.gpus_per_node=3"], 3, "the seed worker (3 ranks)")
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = sorted((json.loads(p.read_text()) for p in out.glob("rank-*.json")), key=lambda r: r["pp_rank"])
    assert [r["torch_seed"] for r in ranks] == [r["seed"] + 100 * r["pp_rank"] for r in ranks]
    # GPU init path: weights come from the stage's RNG tracker, so stage 2's first layer is not stage 1's
    assert ranks[1]["gpu_init"] != ranks[2]["gpu_init"]
