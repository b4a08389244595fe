"""Rank side: GPT train/valid/test datasets from ``DataConfig`` with Megatron-Core's blended dataset builder.

Index caches and node-local filesystems
---------------------------------------
Megatron-Core's builder writes the document/sample/shuffle index caches (``.npy`` files under
``path_to_cache``) on *global* rank 0 only, then a barrier, then every other rank loads them. That silently
assumes ``path_to_cache`` is shared by all nodes: on node-local disks, ranks of the other nodes find no cache.

We make the cache per node and build it once per node:

1. the cache directory is ``<cache_dir>/<hostname>`` (``cache_dir`` defaults to a node-local temp folder), so
   nodes never write the same files even when ``cache_dir`` happens to be shared;
2. on the first rank of each node (``LOCAL_RANK == 0``) we build the datasets once *as a single process* — the
   builder's distributed checks are short-circuited for that call only (:func:`_as_single_process`), so it
   computes and saves the indices itself instead of waiting for global rank 0;
3. a world barrier; then every rank runs the normal builder, which now only loads (every lookup is a hit).

Two jobs on one node (two 4-GPU jobs on an 8-GPU node, a test suite beside a smoke run, two "nodes" of a test on
one machine) share that directory, and Megatron-Core writes its ``.npy`` files in place (``numpy.save`` to the
final name, gpt_dataset.py ``_build_document_sample_shuffle_indices``): a builder that checks for a cache hit
while another writes sees the files half there, builds again over them, or loads a half-written one. So a
builder holds an exclusive ``flock`` on ``<cache dir>/.build.lock`` (:func:`_building`); the other job's builder
waits, then finds every file complete (hits), and no rank reads before its own node's builder is past the lock.
``flock`` is node-local on NFS/Lustre unless the mount shares locks: what it protects is the node's own folder.

The indices are a deterministic function of (files, split, seed, sizes, sequence length), so every node's
copy is identical. Building costs 0.01-0.1 s per dataset (measured), so doing it once per node is cheap.
Call this from every rank after ``torch.distributed`` / ``parallel_state`` is initialised (or in a single
process without it).
"""
from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from typing import Any, List, Optional, Tuple

from launcher.core.blend import prefixes_and_weights
from launcher.core.paths import absolute


class DataFilesChanged(Exception):
    """A dataset file no longer matches what the login node's pre-flight checked (truncated, rewritten, gone):
    every rank that reads data stops with this one line naming the file (not retried: it would fail the same)."""


def check_files(data: Any) -> None:
    """Each blend prefix's .bin still has the size its .idx describes (seconds before Megatron mmaps them; a
    .bin truncated after render otherwise fails mid-step with a numpy offset error naming no file)."""
    from launcher.core.indexed_files import bin_mismatch

    if data.kind == "mock":
        return
    prefixes, _ = prefixes_and_weights(data.blend)
    for i, shown in enumerate(prefixes):
        why = bin_mismatch(absolute(shown))
        if why:
            raise DataFilesChanged(f"data.blend={shown!r}: {why} (changed since the data pre-flight: truncated, "
                                   "rewritten or removed); restore the files or rebuild them with python -m "
                                   "data.preprocess, then run again")


def default_cache_dir() -> str:
    """Node-local default: $TMPDIR/megatron-data-cache-<uid>."""
    return os.path.join(tempfile.gettempdir(), f"megatron-data-cache-{os.getuid()}")


def node_cache_dir(cache_dir: Optional[str]) -> str:
    return os.path.join(cache_dir or default_cache_dir(), socket.gethostname() or "node")


class _MockTokenizer:
    """For mock data without a tokenizer.json: only vocab_size and eod are read."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.unique_identifiers = {"class": "MockTokenizer", "vocab_size": vocab_size}


@contextlib.contextmanager
def _as_single_process():
    """Make Megatron's dataset code see no process group while this rank builds its node's caches alone."""
    import torch.distributed as dist

    saved = dist.is_initialized
    dist.is_initialized = lambda: False  # read at call time by megatron.core.datasets
    try:
        yield
    finally:
        dist.is_initialized = saved


@contextlib.contextmanager
def _building(path_to_cache: str):
    """Hold this node's cache-build lock (see the module docstring) while building into ``path_to_cache``."""
    import fcntl

    os.makedirs(path_to_cache, exist_ok=True)
    with open(os.path.join(path_to_cache, ".build.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed, also if this process dies
        yield


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def gpt_dataset_config(*, data: Any, seq_length: int, seed: int, cache_dir: Optional[str], tokenizer: Any):
    """The GPTDatasetConfig for a DataConfig (blend resolved against the repository root)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    blend = None
    if data.kind != "mock":
        prefixes, weights = prefixes_and_weights(data.blend)
        if not prefixes:
            raise ValueError("data.blend is empty; set data.blend=[path/prefix] or data.kind=mock")
        blend = ([absolute(p) for p in prefixes], weights)
    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=data.split,
        path_to_cache=node_cache_dir(cache_dir),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # Causal masking is the attention kernel's job (attn_mask_type=causal); a [1, s, s] mask per sample
        # would cost s^2 bytes and time in every __getitem__ for nothing.
        create_attention_mask=False,
        mmap_bin_files=True,
    )


def build_gpt_datasets(*, data: Any, seq_length: int, seed: int, train_samples: int, valid_samples: int,
                       test_samples: int, cache_dir: Optional[str], vocab_size: Optional[int] = None,
                       ) -> Tuple[Any, Any, Any]:
    """(train, valid, test) datasets; a split with no samples (or zero split weight) is None.

    ``data.kind == "mock"`` gives MockGPTDataset (synthetic tokens); ``vocab_size`` is then used when
    ``data.tokenizer`` is null (default 8192, the smoke model's).
    """
    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    from launcher.rank.tokenizer import load_tokenizer

    check_files(data)

    if data.tokenizer:
        tokenizer = load_tokenizer(absolute(data.tokenizer))
    elif data.kind == "mock":
        tokenizer = _MockTokenizer(vocab_size or 8192)
    else:
        raise ValueError("data.tokenizer is null; set data.tokenizer=path/to/tokenizer.json")
    config = gpt_dataset_config(data=data, seq_length=seq_length, seed=seed, cache_dir=cache_dir, tokenizer=tokenizer)
    cls = MockGPTDataset if data.kind == "mock" else GPTDataset
    sizes: List[int] = [int(train_samples), int(valid_samples), int(test_samples)]

    def build():
        return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()

    distributed = dist.is_available() and dist.is_initialized()
    if not distributed:
        with _building(config.path_to_cache):
            return tuple(build())  # type: ignore[return-value]
    if _local_rank() == 0:
        with _building(config.path_to_cache), _as_single_process():
            build()  # writes this node's caches (or finds another job's, complete)
    dist.barrier()
    datasets = build()  # every rank: cache hits only
    return tuple(datasets)  # type: ignore[return-value]
