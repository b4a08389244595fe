"""Tensor-parallel ranks get their micro-batch by broadcast from TP rank 0, as in Megatron-LM (``pretrain_gpt.py``
``get_batch`` -> ``megatron.core.utils.get_batch_on_this_tp_rank``): only TP rank 0 reads the data iterator (the
others build no loader), each pipeline stage receives what it needs (first: tokens and position ids; last: labels
and loss mask; MTP or PP = 1: all four), on the compute device (run under the NCCL emulation, which refuses host
tensors in a collective), and the losses are bitwise those of every TP rank reading its own copy."""
from __future__ import annotations

import json
import os
import types

import pytest
import torch

from _rank_harness import ROOT, TINY, layout, run_worker

STAGE_KEYS = {(True, False, False): {"tokens", "position_ids"}, (False, True, False): {"labels", "loss_mask"},
              (False, True, True): {"tokens", "position_ids", "labels", "loss_mask"}}
"""Megatron-Core's get_batch_on_this_tp_rank with PP > 1: (first, last, mtp) -> the keys that are not None."""


def test_tp2_pp2_only_tp_rank_0_reads_and_the_stages_get_megatrons_keys(tmp_path):
    out = tmp_path / "out"
    env = dict(LAUNCHER_NCCL_EMULATION="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "_nccl_site"), os.environ.get("PYTHONPATH", "")]))
    overrides = [*TINY, *layout(tp=2, pp=2), "train.train_steps=2", "cluster.gpus_per_node=4"]
    proc = run_worker(ROOT / "tests" / "_tp_batch_worker.py", [out, *overrides], 4, "the TP batch worker", env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    reports = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]
    microbatches = 2 * 4  # 2 steps x (global batch 8 / micro batch 2)
    reads = {(rep["tp"], rep["pp"]): rep["now"]["reads"] for rep in reports}
    assert reads == {(0, 0): microbatches, (0, 1): microbatches, (1, 0): 0, (1, 1): 0}, reads
    assert {(rep["tp"], rep["pp"]): rep["production_reads"] for rep in reports} == \
        {(0, 0): [True], (0, 1): [True], (1, 0): [False], (1, 1): [False]}  # no loader off TP rank 0
    for r, rep in enumerate(reports):
        now, former = rep["now"], rep["former"]
        assert former["reads"] == microbatches  # the former forward step: every TP rank read its own
        assert len(now["calls"]) == microbatches
        keys = STAGE_KEYS[(now["first"], now["last"], now["mtp"])]
        for i, call in enumerate(now["calls"]):
            assert {k for k, same in call.items() if same is not None} == keys, (r, i, call)
            assert all(same for same in call.values() if same is not None), (r, i, call)  # TP rank 0's batch
        assert now["losses"] == former["losses"] and now["grad_norms"] == former["grad_norms"], (r, now, former)
    assert any(rep["now"]["losses"][0] for rep in reports)  # the last stage reported a loss


# ---------------------------------------------------------------------------------- one process, by stage
class _Chunk:
    """A GPTModel stand-in under a DDP-like ``.module``: its stage flags and what it was given."""

    def __init__(self, first, last, mtp):
        self.module = types.SimpleNamespace(pre_process=first, post_process=last, mtp_process=mtp)


def _batch():
    g = torch.Generator().manual_seed(0)
    return {"tokens": torch.randint(0, 100, (2, 8), generator=g), "labels": torch.randint(0, 100, (2, 8), generator=g),
            "loss_mask": torch.ones(2, 8), "position_ids": torch.arange(8).repeat(2, 1)}


@pytest.mark.parametrize("first,last,mtp,pp", [
    (True, False, False, 2), (False, True, False, 2), (False, True, True, 2), (True, True, False, 1),
    (False, False, False, 2)])
def test_each_stage_keeps_what_megatron_gives_it(monkeypatch, first, last, mtp, pp):
    from megatron.core import parallel_state as ps

    from _rank_harness import single_process_group
    from launcher.rank.batch import BATCH_KEYS, batch_on_this_tp_rank

    single_process_group()
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: pp)
    batch = _batch()
    taken = []

    def iterator():
        taken.append(1)
        yield {k: v.clone() for k, v in batch.items()}

    got = batch_on_this_tp_rank(iterator(), _Chunk(first, last, mtp), (2, 8))
    want = set(BATCH_KEYS) if pp == 1 else STAGE_KEYS.get((first, last, mtp), set())
    assert {k for k, v in got.items() if v is not None} == want
    assert all(torch.equal(got[k], batch[k]) for k in want)
    assert len(taken) == (1 if want else 0)  # a middle stage reads nothing


def test_a_stand_in_model_without_stage_flags_reads_when_given_an_iterator():
    from launcher.rank.batch import BATCH_KEYS, batch_on_this_tp_rank

    assert batch_on_this_tp_rank(None, lambda *a: None) == dict.fromkeys(BATCH_KEYS)
    batch = _batch()
    got = batch_on_this_tp_rank(iter([batch]), lambda *a: None)
    assert all(torch.equal(got[k], batch[k]) for k in BATCH_KEYS)
