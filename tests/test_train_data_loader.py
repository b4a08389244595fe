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


def test_chunks_off_the_pipeline_ends_get_no_loader_and_read_nothing(tmp_path):
    """Megatron-LM's get_batch gives middle pipeline stages no batch: no DataLoader (no workers) is built for a
    chunk that reads none, and forward_step then feeds the model Nones without touching an iterator."""
    from launcher.config import compose_job
    from launcher.rank import data, loop

    job = compose_job(["data=mock", "model.seq_length=16", "model.vocab_size=256", "train.global_batch_size=4",
                       "train.micro_batch_size=2"])
    train_iters, valid_iters = data.build_train_valid_iterators(
        data=job.data, model=job.model, train=job.train, steps=2, consumed_samples=0, dp_rank=0, dp_size=1,
        cache_dir=str(tmp_path), num_chunks=3, reads=[True, False, True])
    assert train_iters[1] is None and valid_iters()[1] is None
    assert next(train_iters[0])["tokens"].shape == (2, 16)

    seen = {}

    def model(tokens, position_ids, attention_mask, labels=None, loss_mask=None):
        seen.update(tokens=tokens, labels=labels)
        return torch.zeros(1)

    loop.forward_step(None, model)
    assert seen == {"tokens": None, "labels": None}
