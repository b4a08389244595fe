"""train.nonfinite with the real step loop (launcher.rank.loop.Loop) in one process, the model's forward/backward
replaced by one that returns a NaN loss (and NaN gradients) at a chosen step: 'stop' returns at that step
before any checkpoint; 'skip' drops that step's update (no optimizer or scheduler step) and carries on."""
from __future__ import annotations

import math
import types

import torch

from _rank_harness import single_process_group
from launcher.config import compose_job
from launcher.rank.loop import Hooks, Loop


class _Chunk(torch.nn.Module):
    # what Loop reads of a Megatron chunk's config (get_model_config): a dense model, no MoE or MTP losses
    config = types.SimpleNamespace(num_moe_experts=None, mtp_num_layers=None)

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4))
        self.weight.main_grad = torch.zeros(4)

    def zero_grad_buffer(self):
        self.weight.main_grad.zero_()


class _Counter:
    def __init__(self):
        self.steps, self.param_groups = 0, [{"lr": 0.1}]

    def zero_grad(self):
        pass

    def step(self, increment=1):
        self.steps += 1
        return True, 1.0, 0


def _loop(policy: str, bad_step: int):
    single_process_group()
    train = compose_job([f"train.nonfinite={policy}", "train.clip_grad=0"]).train
    chunk, optimizer, scheduler = _Chunk(), _Counter(), _Counter()
    lp = Loop(model=[chunk], optimizer=optimizer, scheduler=scheduler, train=train, seq_length=8,
              num_microbatches=1, kind="1f1b", dp_size=1, steps=5, save_interval=1, flops_per_token=1.0,
              tokens_per_step=8, world=1)

    def fwd_bwd(**_):
        bad = lp.step + 1 == bad_step
        chunk.weight.main_grad.fill_(math.nan if bad else 1.0)
        return [{"lm loss": torch.tensor(math.nan if bad else 2.0)}]

    lp.fwd_bwd = fwd_bwd
    notes, saves = [], []
    why = lp.run([iter(())], lambda: None, Hooks(on_checkpoint=lambda: saves.append(lp.step), on_note=notes.append))
    return why, lp, optimizer, scheduler, notes, saves


def test_stop_returns_at_the_bad_step_before_its_checkpoint():
    why, lp, optimizer, _, _, saves = _loop("stop", 3)
    assert why == "nonfinite" and lp.step == 3
    assert lp.stop_reason.startswith("non-finite loss nan") and lp.stop_reason.endswith("at step 3")
    assert saves == [1, 2]  # nothing saved at or after step 3


def test_skip_drops_that_update_and_continues():
    why, lp, optimizer, scheduler, notes, saves = _loop("skip", 3)
    assert why == "done" and lp.step == 5
    assert optimizer.steps == 4 and scheduler.steps == 4  # step 3's update was not applied
    assert notes == ["warning: non-finite loss nan, grad norm nan at step 3: update skipped (train.nonfinite=skip)"]
    assert saves == [1, 2, 3, 4, 5]
