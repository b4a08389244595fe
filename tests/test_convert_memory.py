"""The FSDP <-> DP converter streams (launcher/rank/checkpoint/convert.py): a rank's peak host memory while it fills
its load template from a checkpoint of the other format grows by one stored chunk and one box at a time, not by the
checkpoint. tests/_convert_memory_worker.py writes a 302 MB fsdp_dtensor-shaped checkpoint (8 layers, fp32, gated
fc1 stored as halves) in one process and converts it into a DDP rank's torch_dist template (model, fp32 main
weights, both Adam moments; the tensors resident before the load, as a rank's are) in another.

Measured here (2026-12-06, load ~10): the streaming converter's peak grew by 32 MB, 0.11x the checkpoint; the
whole-checkpoint reader it replaced (every rank ``dcp.load``-ed the whole source, merged the gated halves, then
copied each slice) by 708 MB, 2.34x (that version of checkpoint_convert.py, commit 7e7d0be, put in place: this
test fails). The bound, a quarter of the
checkpoint, is far from both: a fragmented allocator or a larger read buffer does not reach it, and reading the
whole checkpoint cannot stay under it. Values are checked equal too, so a converter that skipped reads would fail.
"""
from __future__ import annotations

import json
import subprocess
import sys

from _rank_harness import ROOT, run_env

WORKER = ROOT / "tests" / "_convert_memory_worker.py"
BOUND = 0.25


def _run(*args) -> str:
    # PYTHONPATH: this checkout's launcher, whatever the environment's editable install points at
    env = run_env({"PYTHONPATH": str(ROOT)})
    proc = subprocess.run([sys.executable, str(WORKER), *map(str, args)], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_a_rank_converting_a_checkpoint_holds_a_chunk_at_a_time_not_the_checkpoint(tmp_path):
    ckpt = tmp_path / "fsdp"
    _run("write", ckpt)
    got = json.loads(_run("convert", ckpt).strip().splitlines()[-1])
    size, grown = got["checkpoint_bytes"], got["grown_bytes"]
    assert size > 250e6 and got["checked"] == 4 * 8 * 3 * 1024 * 1024, got  # model, main, 2 moments; 8 layers
    assert grown < BOUND * size, (f"peak RSS grew by {grown / 1e6:.0f} MB converting a {size / 1e6:.0f} MB "
                                  f"checkpoint ({grown / size:.2f}x; bound {BOUND}x)")
