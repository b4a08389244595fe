"""Training/validation batches for this rank: one call, ``build_train_valid_iterators``.

Datasets come from ``launcher.rank.datasets.build_gpt_datasets`` (GPTDataset over the blend, or MockGPTDataset for
kind=mock). Every rank of a data-parallel replica that reads gets the same micro-batches (pipeline stages take
what they need; only tensor-parallel rank 0 reads and broadcasts to its TP group, ``chunks_reading_data``), in
Megatron's sampler order: micro-batch m of step s on DP rank r holds global samples ``s*G + m*b*d + r*b ... + b``
(G global batch, b micro batch, d DP size), so any layout with the same global batch sees the same samples per step.
"""
from __future__ import annotations

import os

from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from launcher.schema import DataConfig, ModelConfig, Schedule, TrainConfig


def dataset_sizes(train: TrainConfig, steps: int) -> List[int]:
    evals = (steps // train.eval_interval + 1) if train.eval_interval else 1
    return [steps * train.global_batch_size, evals * max(1, train.eval_iters) * train.global_batch_size, 0]


class MicroBatchSampler:
    """Indices of this rank's micro-batches, in Megatron's sampler order, from ``start`` on (endless).

    Wraps to the start of the dataset if it runs out (only when the sizes asked for were short)."""

    def __init__(self, length: int, *, start: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        self.length, self.start, self.b, self.dp_rank, self.dp_size = length, start, micro_batch_size, dp_rank, dp_size

    def __iter__(self) -> Iterator[List[int]]:
        index, span = self.start, self.b * self.dp_size
        while True:
            first = index + self.dp_rank * self.b
            if first + self.b > self.length:
                index, first = 0, self.dp_rank * self.b
            yield list(range(first, first + self.b))
            index += span


def _collate(samples: list) -> dict:
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
            for key in ("tokens", "labels", "loss_mask", "position_ids")}


def _worker_ignores_stop_signals(worker_id: int) -> None:
    """scancel and preemption signal every process of the step, loader workers too: a worker that died of it
    would fail the step its rank is finishing before the stop checkpoint. The rank answers the signal
    (launcher/rank/signals.py); its workers ignore SIGINT/SIGHUP/SIGUSR1, and SIGTERM unless their rank sent it
    (the DataLoader's and multiprocessing's own shutdown terminate workers with SIGTERM: ignoring that would hang
    the rank at exit). Python cannot see a signal's sender in a handler, so SIGTERM is blocked and read with
    sigwaitinfo by a watcher thread."""
    import signal
    import threading

    signal.set_wakeup_fd(-1)  # the rank's wake-up socket, inherited through fork
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def watch():
        while True:
            info = signal.sigwaitinfo({signal.SIGTERM})
            if info.si_pid == parent or os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="sigterm-from-rank", daemon=True).start()


def _batches(dataset, *, start: int, train: TrainConfig, dp_rank: int, dp_size: int, num_workers: int) -> Iterator[dict]:
    """Micro-batches through a torch DataLoader: with workers, sample assembly overlaps the training step."""
    sampler = MicroBatchSampler(len(dataset), start=start, micro_batch_size=train.micro_batch_size,
                                dp_rank=dp_rank, dp_size=dp_size)
    # Its own generator: iter(DataLoader) draws the workers' base seed from it. Without one it draws from the
    # global torch RNG, shifting the dropout stream by one draw per iterator (evaluations included), so a
    # resumed run (RNG restored, then iterators built) diverged from the uninterrupted one. The batches do not
    # depend on the base seed (the sampler fixes the order), so a constant seed is exact across resumes.
    generator = torch.Generator()
    generator.manual_seed(train.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=_collate,
                                         num_workers=num_workers, pin_memory=torch.cuda.is_available(),
                                         persistent_workers=False, generator=generator,
                                         worker_init_fn=_worker_ignores_stop_signals if num_workers else None)
    return iter(loader)


def chunks_reading_data(num_chunks: int, kind: str = Schedule.ONE_F_ONE_B) -> List[bool]:
    """Per model chunk of this rank: does it read batches (first or last pipeline stage of the whole
    pipeline: tokens/position ids for the embedding, labels/loss mask for the loss and MTP)? Under zb_v both
    are rank 0's (launcher.core.pipeline.schedules.stage_of). Only tensor-parallel rank 0 reads: it broadcasts each
    micro-batch to the other TP ranks (launcher.rank.batch.batch_on_this_tp_rank), which build no loader, as
    in Megatron-LM (training.py ``build_train_valid_test_data_loaders``: loaders on TP rank 0 only)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_rank() != 0:
        return [False] * num_chunks
    if kind == Schedule.ZB_V:
        from launcher.core.pipeline.schedules import stage_of

        p, r = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        return [stage_of(kind, p, r, c) in (0, p * num_chunks - 1) for c in range(num_chunks)]

    def vp(c):
        return c if num_chunks > 1 else None
    return [ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp(c))
            or ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp(c)) for c in range(num_chunks)]


def build_train_valid_iterators(*, data: DataConfig, model: ModelConfig, train: TrainConfig, steps: int,
                                consumed_samples: int, dp_rank: int, dp_size: int, cache_dir: str,
                                num_chunks: int = 1, reads: Optional[Sequence[bool]] = None) -> Tuple[list, callable]:
    """Train iterators (one per virtual pipeline chunk, each yielding this rank's micro-batches from
    ``consumed_samples`` on) and a factory of fresh validation iterators (same shape; every evaluation
    reads the same validation samples, so eval losses are comparable across steps).

    ``reads[c]`` says whether chunk c reads batches: as in Megatron-LM (pretrain_gpt.py ``get_batch`` returns
    Nones off the first and last pipeline stage), a chunk that is neither gets ``None`` instead of a loader and
    its forward step reads nothing, so middle stages start no DataLoader workers. The datasets are still built
    on every rank: the per-node index-cache build ends in a world barrier (launcher/rank/datasets.py)."""
    from launcher.rank.datasets import build_gpt_datasets

    train_samples, valid_samples, test_samples = dataset_sizes(train, steps)
    train_ds, valid_ds, _ = build_gpt_datasets(
        data=data, seq_length=model.seq_length, seed=train.seed, train_samples=train_samples,
        valid_samples=valid_samples, test_samples=test_samples, cache_dir=cache_dir, vocab_size=model.vocab_size)
    kw = dict(train=train, dp_rank=dp_rank, dp_size=dp_size, num_workers=data.num_workers)
    reads = list(reads) if reads is not None else [True] * num_chunks
    train_iters = [_batches(train_ds, start=consumed_samples, **kw) if reads[c] else None for c in range(num_chunks)]

    def valid_iters():
        if valid_ds is None:
            return None
        # Evaluation reads a few batches; starting workers for each evaluation would cost more than it saves.
        return [_batches(valid_ds, start=0, **{**kw, "num_workers": 0}) if reads[c] else None
                for c in range(num_chunks)]

    return train_iters, valid_iters
