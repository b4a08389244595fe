"""The rank's micro-batch loader: Megatron's sampler order, resumable, identical with and without workers."""
from __future__ import annotations

import torch

from launcher.rank.data import MicroBatchSampler, _batches
from launcher.schema import TrainConfig


class Numbers(torch.utils.data.Dataset):
    """Sample i is a sequence that encodes i, so batches can be checked exactly."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        tokens = torch.full((4,), i, dtype=torch.long)
        return {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(4), "position_ids": torch.arange(4)}


def test_sampler_order_follows_megatron_and_wraps():
    # micro batch 2, DP 2: DP rank 1 takes samples 2-3 of each 4-sample span.
    it = iter(MicroBatchSampler(10, start=0, micro_batch_size=2, dp_rank=1, dp_size=2))
    assert [next(it) for _ in range(3)] == [[2, 3], [6, 7], [2, 3]]  # third span would pass the end: wraps
    it = iter(MicroBatchSampler(40, start=8, micro_batch_size=2, dp_rank=0, dp_size=2))
    assert next(it) == [8, 9]  # resuming after 8 consumed samples


def test_workers_give_the_same_batches_as_the_main_process():
    train = TrainConfig(micro_batch_size=3, global_batch_size=6)
    inline = _batches(Numbers(), start=6, train=train, dp_rank=1, dp_size=2, num_workers=0)
    workers = _batches(Numbers(), start=6, train=train, dp_rank=1, dp_size=2, num_workers=2)
    for _ in range(5):
        a, b = next(inline), next(workers)
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key])
    first = next(_batches(Numbers(), start=6, train=train, dp_rank=1, dp_size=2, num_workers=2))
    assert first["tokens"][:, 0].tolist() == [9, 10, 11]
