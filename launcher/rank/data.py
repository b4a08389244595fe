"""Training/validation batches for this rank: one call, ``build_train_valid_iterators``.

Datasets come from ``data.datasets.build_gpt_datasets`` (GPTDataset over the blend, or MockGPTDataset for
kind=mock); a plain Megatron builder here is the fallback if that module is absent. Every rank of a data-parallel replica reads
the same micro-batches (pipeline stages take what they need), in Megatron's sampler order: micro-batch m of
step s on DP rank r holds global samples ``s*G + m*b*d + r*b ... + b`` (G global batch, b micro batch,
d DP size), so any layout with the same global batch sees the same samples per step.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import torch

from launcher.schema import DataConfig, ModelConfig, TrainConfig


class _Tokenizer:
    """What megatron.core.datasets needs from a tokenizer: vocab size, EOD id, identity for caches."""

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size, self.eod, self.pad = vocab_size, eod, -1

    @property
    def unique_identifiers(self):
        return {"class": "launcher.rank.data._Tokenizer", "vocab_size": self.vocab_size, "eod": self.eod}


def _eod_id(tokenizer_path: Optional[str]) -> int:
    if not tokenizer_path or not Path(tokenizer_path).exists():
        return 0
    import json

    added = json.loads(Path(tokenizer_path).read_text()).get("added_tokens", [])
    for token in added:
        if token["content"] in ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>"):
            return int(token["id"])
    return 0


def _megatron_datasets(*, data: DataConfig, model: ModelConfig, seed: int, sizes: List[int],
                       cache_dir: str):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    blend = None
    if data.kind == "indexed":
        items = list(data.blend)
        if items and not isinstance(items[0], str):  # [w1, path1, w2, path2]
            blend = ([str(p) for p in items[1::2]], [float(w) for w in items[0::2]])
        else:
            blend = ([str(p) for p in items], None)
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=model.seq_length, blend=blend, split=data.split,
        tokenizer=_Tokenizer(model.vocab_size, _eod_id(data.tokenizer)), path_to_cache=cache_dir,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False)
    cls = MockGPTDataset if data.kind == "mock" else GPTDataset
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()


def _datasets(*, data: DataConfig, model: ModelConfig, seed: int, sizes: List[int], cache_dir: str):
    """(train, valid, test) via data.datasets.build_gpt_datasets (node-local index caches), falling back
    to the plain Megatron builder above when that module is absent."""
    if importlib.util.find_spec("data") is not None and importlib.util.find_spec("data.datasets") is not None:
        from data.datasets import build_gpt_datasets

        return build_gpt_datasets(data=data, seq_length=model.seq_length, seed=seed, train_samples=sizes[0],
                                  valid_samples=sizes[1], test_samples=sizes[2], cache_dir=cache_dir,
                                  vocab_size=model.vocab_size)
    return _megatron_datasets(data=data, model=model, seed=seed, sizes=sizes, cache_dir=cache_dir)


def dataset_sizes(train: TrainConfig, steps: int) -> List[int]:
    evals = (steps // train.eval_interval + 1) if train.eval_interval else 1
    return [steps * train.global_batch_size, evals * max(1, train.eval_iters) * train.global_batch_size, 0]


def _batches(dataset, *, start: int, train: TrainConfig, dp_rank: int, dp_size: int) -> Iterator[dict]:
    b, step_span = train.micro_batch_size, train.micro_batch_size * dp_size
    index = start
    while True:
        first = index + dp_rank * b
        if first + b > len(dataset):
            index = first = dp_rank * b  # wrap around (validation reuse)
        samples = [dataset[i] for i in range(first, first + b)]
        yield {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
               for key in ("tokens", "labels", "loss_mask", "position_ids")}
        index += step_span


def build_train_valid_iterators(*, data: DataConfig, model: ModelConfig, train: TrainConfig, steps: int,
                                consumed_samples: int, dp_rank: int, dp_size: int, cache_dir: str,
                                num_chunks: int = 1) -> Tuple[list, callable]:
    """Train iterators (one per virtual pipeline chunk, each yielding this rank's micro-batches from
    ``consumed_samples`` on) and a factory of fresh validation iterators (same shape)."""
    import os

    os.makedirs(cache_dir, exist_ok=True)
    sizes = dataset_sizes(train, steps)
    train_ds, valid_ds, _ = _datasets(data=data, model=model, seed=train.seed, sizes=sizes, cache_dir=cache_dir)
    kw = dict(train=train, dp_rank=dp_rank, dp_size=dp_size)
    train_iters = [_batches(train_ds, start=consumed_samples, **kw) for _ in range(num_chunks)]

    def valid_iters():
        if valid_ds is None:
            return None
        return [_batches(valid_ds, start=0, **kw) for _ in range(num_chunks)]

    return train_iters, valid_iters
