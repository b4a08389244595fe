"""checkpoint.async_save: torch_dist checkpoints written in the background through Megatron-Core's asynchronous
save (``dist_checkpointing.save(..., async_sharded_save=True)`` + ``AsyncCallsQueue``), published with every guarantee
of a synchronous save (``launcher/rank/checkpoint/store.py``: the manifest last, the lock, pruning after publishing only).

Megatron-LM's pattern mirrored (megatron/training/checkpointing.py ``save_checkpoint`` -> ``schedule_async_save``;
training.py calls ``maybe_finalize_async_save(blocking=False)`` every iteration and ``blocking=True`` before it
exits): the entry (``launcher/rank/entry.py``) polls every step, waits before a stop or end save and before a
rollback, and starts no second save while one is in flight.
"""
from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch

from launcher.core.checkpoint.directory import own_crcs
from launcher.rank.checkpoint.store import (_failed_save, _publish_agreed, _rank, _sharded_state, agree_or_raise,
                                      save_strategy)


def persistent_worker_works() -> bool:
    """Whether Megatron-Core's persistent checkpoint worker (``AsyncCallsQueue(persistent=True)``,
    ``PersistentAsyncCaller``; Megatron-LM's ``--use-persistent-ckpt-worker``, which its arguments.py requires for
    ``--async-save`` in this version) can serve this rank. Not on CPU, measured with 0.19.2 and gloo: its worker
    starts with ``torch.cuda.set_device(rank % torch.cuda.device_count())`` (strategies/async_utils.py
    ``async_loop``), a ZeroDivisionError without GPUs, after which the rank waits on its preload queue forever;
    and it would hand CPU tensors to the spawned worker through shared memory (torch.multiprocessing moves them
    there), i.e. the live weights the next steps update, not a copy. So CPU ranks use ``TemporalAsyncCaller``: it
    forks a writer per save after the shards were staged, and fork's copy-on-write pages are the snapshot of the
    weights at the save's step. On GPU the persistent worker copies the shards to host memory (its preload) before
    the trainer goes on, as Megatron-LM runs it (not verified on a GPU here)."""
    return torch.cuda.is_available()


def _die_with_parent() -> None:
    """In the writer process: SIGKILL with the rank (Linux PR_SET_PDEATHSIG). A writer left behind by a killed rank
    would keep its inherited stdout/stderr open (the job's log readers then never see EOF) and keep writing into a
    ``.tmp`` directory that the restarted run may reuse for the same step."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the rank died before the line above
        os._exit(1)


def _background_write(step: int, write_fn: Callable, *args, **kwargs) -> None:
    """The writer process's body: Megatron-Core's file writer (``FileSystemWriterAsync.
    write_preloaded_data_multithread``) for the checkpoint of ``step`` (tests/_crash_site slows it per step)."""
    _die_with_parent()
    write_fn(*args, **kwargs)


class AsyncSaves:
    """checkpoint.async_save: torch_dist checkpoints written by a background process while training goes on, at
    most one at a time, through Megatron-Core's ``AsyncCallsQueue`` (as Megatron-LM's ``schedule_async_save`` /
    ``maybe_finalize_async_save``, megatron/training/async_utils.py). Every guarantee of a synchronous save holds:
    the request's finalize step (Megatron's ``save_state_dict_async_finalize``: write results gathered, ``.metadata``
    written; then metadata.json and a barrier) runs on every rank once every rank's writer is done, then this run's
    own finalize (``_publish_agreed``: the manifest last, the rename, pruning). A kill before that leaves only an
    ``iter_N.tmp`` without a manifest, which resume ignores. Collective: every call on every rank."""

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue(persistent=persistent_worker_works())
        self.step: Optional[int] = None
        """The step of the checkpoint being written, None when none is."""

    def in_flight(self) -> bool:
        """The same on every rank (a save is scheduled and finalized by all ranks together)."""
        return self.queue.get_num_unfinalized_calls() > 0

    def start(self, *, model, optimizer, scheduler, consumed: int, tmp: Path, final: Path, ckpt_dir: Path,
              checksum: bool, run_state, started: float, on_published, publish_args: dict) -> None:
        """Stage this rank's shards and hand them to the writer (``save``'s background branch)."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

        step, rank = publish_args["step"], _rank()
        try:
            state = _sharded_state(model, optimizer, scheduler, step, consumed, is_loading=False,
                                   optimizer_format=publish_args["optimizer_format"])
            # Megatron-LM's save_checkpoint: dist_checkpointing.save(..., async_sharded_save=args.async_save,
            # async_strategy=args.async_strategy); "mcore" is Megatron-Core's own writer (nvidia-resiliency-ext's
            # "nvrx" is not installed with it)
            request = dist_checkpointing.save(state, str(tmp), save_strategy(), async_sharded_save=True,
                                              async_strategy="mcore")
            message = None
        except BaseException as exc:  # the plan failed before anything was written: as a synchronous save
            request, message = None, _failed_save(exc, final, ckpt_dir, run_state)
        agree_or_raise(message)
        megatron_finalize = list(request.finalize_fns)

        def finalize() -> None:  # every rank, once every rank's writer has finished (AsyncCallsQueue)
            try:
                for fn in megatron_finalize:  # write results -> .metadata, then metadata.json and a barrier
                    fn()
                failed, crcs = None, own_crcs(tmp, checksum=checksum, rank=rank)
            except BaseException as exc:  # a writer's error, raised on every rank by Megatron's finalize
                failed, crcs = _failed_save(exc, final, ckpt_dir, run_state), {}
            self.step = None
            seconds = time.perf_counter() - started
            _publish_agreed(ckpt_dir, tmp, final, failed, crcs, seconds=seconds, **publish_args)
            if on_published is not None:
                on_published(final, seconds)

        write = (partial(_background_write, step, request.async_fn) if request.async_fn is not None else None)
        self.step = step
        self.queue.schedule_async_request(AsyncRequest(write, request.async_fn_args, [finalize],
                                                       request.async_fn_kwargs, preload_fn=request.preload_fn))

    def poll(self) -> None:
        """Each step (Megatron-LM's training loop: ``maybe_finalize_async_save(blocking=False)`` every iteration):
        publish the checkpoint in flight if every rank's writer has finished; else return at once."""
        if self.in_flight():
            self.queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        """Block until the checkpoint in flight (if any) is published: before the next save, a stop save, a
        rollback, the end of training (``maybe_finalize_async_save(blocking=True)``)."""
        if self.in_flight():
            self.queue.maybe_finalize_async_calls(blocking=True)

    def close(self) -> None:
        """The end of the run, after ``wait``: stop a persistent worker (``AsyncCallsQueue.close``)."""
        self.queue.close()
