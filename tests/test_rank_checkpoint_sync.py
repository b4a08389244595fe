"""A checkpoint never holds parameters a step old: with overlap_param_gather (distributed optimizer, GPU) the
parameter all-gather after optimizer.step() is deferred to the next forward, so ``checkpoint.save`` must force
it before writing. Overlap needs CUDA streams, so the DDP wrappers are stand-ins recording what is called."""
from __future__ import annotations

import types

import pytest

from launcher.rank.checkpoint import store as checkpoint


class _Chunk:
    def __init__(self, overlap: bool, log: list):
        self.ddp_config = types.SimpleNamespace(overlap_param_gather=overlap)
        self.log = log

    def start_param_sync(self, *unused, force_sync=False):
        self.log.append(("param_sync", force_sync))


@pytest.mark.parametrize("overlap", [True, False])
def test_save_forces_the_deferred_param_gather_first(tmp_path, monkeypatch, overlap):
    from megatron.core import dist_checkpointing

    from _rank_harness import single_process_group

    single_process_group()
    log = []
    model = [_Chunk(overlap, log), _Chunk(overlap, log)]
    monkeypatch.setattr(checkpoint, "_sharded_state", lambda *a, **k: log.append(("state",)) or {})
    monkeypatch.setattr(dist_checkpointing, "save", lambda state, path, *a: log.append(("write", path)))
    checkpoint.save(tmp_path, model=model, optimizer=None, scheduler=None, step=3, consumed=24)
    if overlap:
        assert log[:3] == [("param_sync", True), ("param_sync", True), ("state",)], log
    else:
        assert ("param_sync", True) not in log and log[0] == ("state",), log
    assert (tmp_path / "latest").read_text().strip() == "iter_0000003"
