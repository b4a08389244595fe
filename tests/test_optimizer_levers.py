"""Issue 41, the optimizer's levers on CPU: the optimizer CPU offload (Megatron-Core's HybridDeviceOptimizer, under
the precision-aware optimizer as Megatron-LM requires) trains like the plain distributed optimizer, moves the share
of the state it was asked to, and resumes bitwise from its own checkpoints. On CPU the "device" is the CPU: the
offloaded share is stepped by the host optimizer (torch's fused AdamW) on its copies and copied back after each
step, the rest by the device optimizer (models/cpu_compat.py ``_hybrid_param_groups_on_cpu``)."""
from __future__ import annotations

import re

import pytest

from _rank_harness import TINY, Run, layout, run_train, run_until, write_bundle

BASE = TINY + layout() + ["precision.dtype=bf16", "parallel.distributed_optimizer=true"]
OFFLOAD = ["precision.precision_aware_optimizer=true", "train.optimizer_cpu_offload=true"]
STEPS, K = 5, 3
REL = 2e-3
"""The host step is torch's fused AdamW on fp32 copies, the plain one Megatron's (torch AdamW, foreach) on fp32 main
weights: the same arithmetic in another kernel order, so the bf16 losses agree to about 1e-3 (measured here:
equal to 4 decimals over 5 steps), not bit for bit on every CPU."""


def _offloaded(bundle) -> list[tuple[int, int]]:
    found = []
    for log in sorted((bundle / "logs").glob("rank-*.log")):
        m = re.search(r"optimizer CPU offload: ([\d,]+) of ([\d,]+) elements", log.read_text())
        assert m, f"{log.name} does not say what was offloaded"
        found.append((int(m[1].replace(",", "")), int(m[2].replace(",", ""))))
    return found


def test_cpu_offload_trains_like_the_plain_optimizer_and_resumes_bitwise(tmp_path, reference_run):
    """Half the state offloaded (both the host and the device optimizer step), the copies overlapped: the losses
    are the plain distributed optimizer's, the rank logs say the share moved, and a run killed after its step-K
    checkpoint (the host optimizer's moments and step go through the distributed optimizer's checkpoint) continues
    with the uninterrupted offloaded run's losses."""
    common = BASE + [f"train.train_steps={STEPS}", f"checkpoint.save_interval={K}"]
    overrides = common + OFFLOAD + ["train.optimizer_offload_fraction=0.5", "train.overlap_cpu_optimizer_d2h_h2d=true"]
    plain, full = reference_run(2, common), reference_run(2, overrides)
    assert sorted(full.losses()) == list(range(1, STEPS + 1))
    for step, loss in plain.losses().items():
        assert full.losses()[step] == pytest.approx(loss, rel=REL), step
    for host, total in _offloaded(full.bundle):  # whole parameters move: at least half, not all
        assert 0.5 * total <= host < total, (host, total)

    bundle = write_bundle(tmp_path / "interrupted", overrides, 2)
    seen = run_until(bundle, 2, marker=f"saved checkpoint {bundle / 'checkpoints' / f'iter_{K:07d}'}")
    assert f"step {K + 1:5d}" not in seen
    proc = run_train(bundle, 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = Run(bundle, proc)
    assert sorted(resumed.steps) == list(range(K + 1, STEPS + 1))
    for step in range(K + 1, STEPS + 1):
        assert resumed.losses()[step] == pytest.approx(full.losses()[step], rel=1e-6), step
