"""Exact resume with dropout > 0: a TP2 run with hidden and attention dropout, killed after its step-3
checkpoint, resumes to the uninterrupted run's losses. Before the DataLoader had its own generator, each
``iter(DataLoader)`` drew its base seed from the global torch RNG after the RNG restore and the dropout masks
shifted (relative 9e-5 at step 4)."""
from __future__ import annotations

from _rank_harness import layout
from test_train_resume import _resume_case

DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1", "data.num_workers=1",
           "train.eval_interval=2", "train.eval_iters=1"]


def test_tp2_with_dropout_and_evaluations_resumes_with_the_same_losses(tmp_path, reference_run):
    _resume_case(tmp_path, 2, layout(tp=2) + DROPOUT, reference_run)
