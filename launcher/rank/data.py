"""Training/validation batches for this rank: one call, ``build_train_valid_iterators``.

Datasets come from ``data.datasets.build_gpt_datasets`` (GPTDataset over the blend, or MockGPTDataset for
kind=mock). Every rank of a data-parallel replica reads the same micro-batches (pipeline stages take what
they need), in Megatron's sampler order: micro-batch m of step s on DP rank r holds global samples ``s*G + m*b*d + r*b ... + b`` (G global batch, b micro batch,
d DP size), so any layout with the same global batch sees the same samples per step.
"""
from __future__ import annotations

from typing import Iterator, List, Tuple

import torch

from launcher.schema import DataConfig, ModelConfig, TrainConfig


def _datasets(*, data: DataConfig, model: ModelConfig, seed: int, sizes: List[int], cache_dir: str):
    """(train, valid, test) from data.datasets (node-local index caches, mock or indexed blend)."""
    from data.datasets import build_gpt_datasets

    return build_gpt_datasets(data=data, seq_length=model.seq_length, seed=seed, train_samples=sizes[0],
                              valid_samples=sizes[1], test_samples=sizes[2], cache_dir=cache_dir,
                              vocab_size=model.vocab_size)


def dataset_sizes(train: TrainConfig, steps: int) -> List[int]:
    evals = (steps // train.eval_interval + 1) if train.eval_interval else 1
    return [steps * train.global_batch_size, evals * max(1, train.eval_iters) * train.global_batch_size, 0]


def _batches(dataset, *, start: int, train: TrainConfig, dp_rank: int, dp_size: int) -> Iterator[dict]:
    b, step_span = train.micro_batch_size, train.micro_batch_size * dp_size
    index = start
    while True:
        first = index + dp_rank * b
        if first + b > len(dataset):  # past the end (only if sizes were short): start over
            index, first = 0, dp_rank * b
        samples = [dataset[i] for i in range(first, first + b)]
        yield {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
               for key in ("tokens", "labels", "loss_mask", "position_ids")}
        index += step_span


def build_train_valid_iterators(*, data: DataConfig, model: ModelConfig, train: TrainConfig, steps: int,
                                consumed_samples: int, dp_rank: int, dp_size: int, cache_dir: str,
                                num_chunks: int = 1) -> Tuple[list, callable]:
    """Train iterators (one per virtual pipeline chunk, each yielding this rank's micro-batches from
    ``consumed_samples`` on) and a factory of fresh validation iterators (same shape; every evaluation
    reads the same validation samples, so eval losses are comparable across steps)."""
    sizes = dataset_sizes(train, steps)
    train_ds, valid_ds, _ = _datasets(data=data, model=model, seed=train.seed, sizes=sizes, cache_dir=cache_dir)
    kw = dict(train=train, dp_rank=dp_rank, dp_size=dp_size)
    train_iters = [_batches(train_ds, start=consumed_samples, **kw) for _ in range(num_chunks)]

    def valid_iters():
        if valid_ds is None:
            return None
        return [_batches(valid_ds, start=0, **kw) for _ in range(num_chunks)]

    return train_iters, valid_iters
