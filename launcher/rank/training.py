"""One rank's training objects, built in one place: ``build(job, layout)`` -> ``Training`` (model chunks,
optimizer, LR scheduler, step loop), the data iterators (``Training.iterators``) and the checkpoint directory's
state for one run (``Checkpointer``).

The rank entry builds through here, and so does every test worker, probe and benchmark that needs the real
objects: a copy of the sequence drifts from what a job runs (recompute, determinism and the backend checks were
left out of copies before; tests/test_layering.py finds a copy). Megatron-LM's order (``pretrain`` in
megatron/training/training.py): ``setup_model_and_optimizer`` (this module's ``build``, then
``Checkpointer.open``: the load), then ``build_train_valid_test_data_iterators`` (``Training.iterators``), then
``train`` (``Loop.run``).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional

from launcher.rank.loop import Loop


@dataclass
class Training:
    """What ``build`` made for this rank: the job and layout it was built from, the DDP- (or Megatron-FSDP-)
    wrapped model chunks, the optimizer, the LR scheduler and the step loop (None when built with ``loop=False``)."""

    job: Any
    layout: Any
    model: List[Any]
    optimizer: Any
    scheduler: Any
    loop: Optional[Loop] = None

    def iterators(self, *, cache_dir: str, consumed: Optional[int] = None, every_rank_reads: bool = False) -> tuple:
        """(train iterators, validation factory) from ``consumed`` samples on (default: the loop's, else 0)."""
        if consumed is None:
            consumed = self.loop.consumed if self.loop is not None else 0
        return iterators(self.job, self.layout, num_chunks=len(self.model), consumed=consumed, cache_dir=cache_dir,
                         every_rank_reads=every_rank_reads)


def build(job, layout, *, loop: bool = True) -> Training:
    """This rank's training objects, built exactly as a production run builds them: the backend checks, TP
    communicator set-up, GPTModel, DDP or Megatron-FSDP wrapper, optimizer (and its CPU offload note), scheduler,
    the model config's hooks and the step loop configured from the job and the layout. ``loop=False``: no loop
    (a worker that drives the schedule itself; the loop installs the stop-signal handlers)."""
    from launcher.rank import optim
    from models import backend, build_model

    tr = job.train
    backend.check_planned_backend(job.precision, layout)
    backend.check_flex_dispatcher(job.model)
    backend.initialize_tp_comm_overlap(model=job.model, parallel=job.parallel, precision=job.precision, train=tr,
                                       layout=layout, schedule_kind=job.schedule.kind)
    chunks = build_model(model=job.model, parallel=job.parallel, precision=job.precision, layout=layout,
                         schedule=job.schedule, seed=tr.seed, recompute=tr.recompute,
                         recompute_num_layers=tr.recompute_num_layers, recompute_modules=tr.recompute_modules,
                         deterministic=tr.deterministic, cuda_graph_impl=tr.cuda_graph_impl,
                         cuda_graph_modules=tr.cuda_graph_modules, cuda_graph_warmup_steps=tr.cuda_graph_warmup_steps,
                         activation_offload_modules=tr.activation_offload_modules,
                         activation_offload_fraction=tr.activation_offload_fraction,
                         min_offloaded_tensor_size=tr.min_offloaded_tensor_size)
    model = optim.wrap_ddp(chunks, parallel=job.parallel, precision=job.precision)
    optimizer = optim.build_optimizer(model, train=tr, parallel=job.parallel, precision=job.precision)
    offloaded = optim.host_offload(optimizer) if tr.optimizer_cpu_offload else None
    if offloaded:  # the rank's log says what the offload fraction came to (whole parameters move)
        print(f"optimizer CPU offload: {offloaded[0]:,} of {offloaded[1]:,} elements' Adam state on the host "
              f"({offloaded[0] / max(1, offloaded[1]):.0%}; train.optimizer_offload_fraction="
              f"{tr.optimizer_offload_fraction:g})", flush=True)
    scheduler = optim.build_scheduler(optimizer, train=tr, steps=layout.steps)
    optim.hook_model_config(model, optimizer, parallel=job.parallel)
    lp = Loop.from_job(job, layout, model, optimizer, scheduler) if loop else None
    return Training(job=job, layout=layout, model=model, optimizer=optimizer, scheduler=scheduler, loop=lp)


def iterators(job, layout, *, num_chunks: int, consumed: int, cache_dir: str, every_rank_reads: bool = False):
    """(train iterators, validation factory) of this rank (launcher.rank.data.build_train_valid_iterators): one
    per model chunk, read where Megatron-LM reads (``chunks_reading_data``: TP rank 0 of the stages holding the
    embedding, the output layer or MTP layers). ``every_rank_reads``: a loader on every rank and chunk (a test
    that compares what each rank would read itself)."""
    from megatron.core import parallel_state as ps

    from launcher.rank import data

    reads = [True] * num_chunks if every_rank_reads else data.chunks_reading_data(num_chunks, job.schedule.kind)
    return data.build_train_valid_iterators(
        data=job.data, model=job.model, train=job.train, steps=layout.steps, consumed_samples=consumed,
        dp_rank=ps.get_data_parallel_rank(), dp_size=layout.dp, num_chunks=num_chunks, reads=reads,
        cache_dir=cache_dir)


class Checkpointer:
    """The checkpoint directory's state for one run of ``training``: start fresh, resume (and the loss-spike
    rollback's resume), the pre-flight space check and the Slurm stop guard, saves (synchronous, or in the
    background under checkpoint.async_save, published through ``published``), and finishing the one in flight.
    ``on_saved(step)``: the caller's note that a checkpoint of ``step`` is published (every rank)."""

    def __init__(self, job, training: Training, ckpt_dir: Path, identity: dict, line: Callable[..., None]):
        from launcher.core.checkpoint.format import checkpoint_format
        from launcher.rank.checkpoint import store as ckpt

        self.job, self.training, self.dir, self.identity, self.line = job, training, ckpt_dir, identity, line
        self.checksum = job.checkpoint.verify == "checksum"
        self.fmt = checkpoint_format(job)
        self.carried = ckpt.CheckpointState()  # the size estimate and the loaded RNG, from call to call
        self.latest: Optional[Path] = None
        self.saved_at = 0
        self.guard = None  # launcher.core.signal_lead.StopGuard, from preflight()
        self.background = None  # checkpoint.async_save: AsyncSaves, from open_background()
        self.on_saved: Callable[[int], None] = lambda step: None

    @property
    def spikes(self):
        return self.training.loop.spikes

    def _resume(self) -> None:
        from launcher.rank.checkpoint import store as ckpt

        t, lp = self.training, self.training.loop
        lp.step, lp.consumed, self.latest = ckpt.resume(
            self.dir, identity=self.identity, load_from=self.job.checkpoint.load, checksum=self.checksum,
            model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, warn=self.line,
            distributed_optimizer=self.job.parallel.distributed_optimizer, fmt=self.fmt, run_state=self.carried)

    def open(self) -> None:
        """checkpoint.resume=false: this run's earlier checkpoints moved aside; else resume from the newest (or
        checkpoint.load); then the loss-spike rule with the window and skips of the checkpoint resumed from."""
        from launcher.rank.checkpoint import store as ckpt

        lp = self.training.loop
        if not self.job.checkpoint.resume:
            moved = ckpt.start_fresh(self.dir, self.identity)
            if moved:
                self.line(f"checkpoint.resume=false: moved {len(moved)} earlier checkpoint(s) of this run aside "
                          f"(e.g. {moved[0].name})")
        else:
            self._resume()
            if self.latest is not None:
                self.line(f"resumed from {self.latest} at step {lp.step} ({lp.consumed} samples consumed)")
        if self.job.train.spike_factor is not None:  # train.spike_factor: the run's rule (launcher/rank/spikes.py)
            from launcher.rank.spikes import SpikeGuard

            lp.spikes = SpikeGuard(self.job.train, self.dir, self.job.schedule.kind, self.line)
            lp.spikes.loaded(ckpt.read_manifest(self.latest) if self.latest is not None else None)
        self.saved_at = lp.step

    def rollback(self) -> None:
        """After a loss spike: the newest checkpoint (all before the spike) loaded again, to replay from it."""
        from launcher.rank.checkpoint import store as ckpt

        self.finish_in_flight()  # a checkpoint still being written is the newest one to roll back to
        self._resume()  # this run's own newest, else the one it started from
        self.spikes.loaded(ckpt.read_manifest(self.latest) if self.latest is not None else None)
        lp = self.training.loop
        self.line(f"rolled back to {self.latest} (step {lp.step}, {lp.consumed} samples consumed): replaying")

    def preflight(self) -> None:
        """Room for a checkpoint in the directory before the first step, and the stop guard's save time."""
        from launcher.rank.checkpoint import store as ckpt

        need = ckpt.checkpoint_shares(self.training.model,
                                      distributed_optimizer=self.job.parallel.distributed_optimizer)
        ckpt.preflight_dir(self.dir, need["total"], run_state=self.carried)
        self.guard = stop_guard(self.job, self.latest, need["busiest_node"], self.line)

    def open_background(self) -> None:
        """checkpoint.async_save: torch_dist files written in the background (launcher/rank/checkpoint/store.py
        AsyncSaves), published when every rank's writer is done; None: every save blocks until published."""
        from launcher.rank.checkpoint.async_save import AsyncSaves

        self.background = AsyncSaves() if self.job.checkpoint.async_save else None

    def published(self, path, took: float, step: int) -> None:
        """Every rank, once the checkpoint of ``step`` is complete (its manifest written)."""
        from launcher.core import signal_lead

        if self.spikes is not None:
            self.spikes.saved()
        self.line(f"saved checkpoint {path}")
        self.on_saved(step)
        guard, slurm = self.guard, self.job.slurm
        guard.saved(took)
        lead = int(os.environ.get(signal_lead.LEAD_ENV) or slurm.signal_lead_s or 0)
        need = guard.needed()
        if os.environ.get("SLURM_JOB_ID") and need > lead:  # USR1 -> the step in flight -> the stop save
            self.line(f"warning: this checkpoint took {took:.0f} s to save; slurm.signal_lead_s={lead} leaves "
                      f"less than {slurm.signal_save_factor:g} x that + a step + {slurm.signal_margin_s} s "
                      f"before the time limit (training stops by itself {need:.0f} s before it instead): submit "
                      f"with slurm.signal_lead_s={math.ceil(need)} or more, or null to derive it from this save")

    def poll(self) -> None:
        """Every step: publish a background save that has finished (Megatron-LM: maybe_finalize_async_save(
        blocking=False) every iteration)."""
        if self.background is not None:
            self.background.poll()
            self.guard.in_flight = self.background.in_flight()

    def finish_in_flight(self) -> None:
        """Publish the checkpoint being written in the background, if any (blocking; collective)."""
        if self.background is not None:
            self.background.wait()
            self.guard.in_flight = False

    def save(self, in_background: bool = False) -> None:
        from launcher.core.checkpoint.directory import checkpoint_name
        from launcher.rank.checkpoint import store as ckpt

        self.finish_in_flight()  # a stop/end save after an async one: that one first (Megatron: one save at a time)
        t, lp, cp, spikes = self.training, self.training.loop, self.job.checkpoint, self.spikes
        self.saved_at, step = lp.step, lp.step
        path = ckpt.save(self.dir, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, step=lp.step,
                         consumed=lp.consumed, keep_last=cp.keep_last, identity=self.identity,
                         checksum=self.checksum, optimizer_format=cp.optimizer_format, fmt=self.fmt,
                         run_state=self.carried,
                         extra={"consumed_samples": lp.consumed,  # the resume plan reads it (resume_plan.py)
                                **({"spikes": spikes.state()} if spikes is not None else {})},
                         background=self.background if in_background else None,
                         on_published=lambda path, took: self.published(path, took, step))
        if path is None:  # the writer runs; AsyncSaves.poll publishes it at a later step
            self.guard.in_flight = True
            self.line(f"writing checkpoint {self.dir / checkpoint_name(step)} in the background "
                      "(checkpoint.async_save)")

    def on_checkpoint(self) -> None:
        """The loop's periodic save: in the background under checkpoint.async_save."""
        self.save(in_background=self.background is not None)

    def close(self) -> None:
        if self.background is not None:
            self.background.close()


def stop_guard(job, resumed, node_bytes: int, line: Callable[..., None]):
    """Stop in time for the Slurm time limit on every attempt (launcher/core/signal_lead.py): the job's end
    time from job.sbatch, this run's save time (the resumed checkpoint's measured one, else the estimate: the
    bytes the busiest node writes under fully parallel save over one node's write bandwidth)."""
    from launcher.core import signal_lead
    from launcher.core.checkpoint import directory as cdir

    measured = (cdir.read_manifest(Path(resumed)) or {}).get("save_seconds") if resumed is not None else None
    save_s = (float(measured) if isinstance(measured, (int, float)) else
              cdir.node_save_s(node_bytes, write_gbps=job.cluster.checkpoint_write_gbps))
    guard = signal_lead.StopGuard(signal_lead.job_end_from_env(), save_s=save_s, factor=job.slurm.signal_save_factor,
                                  margin_s=job.slurm.signal_margin_s)
    if guard.job_end is not None:
        end = time.strftime("%H:%M:%S UTC", time.gmtime(guard.job_end))
        line(f"slurm: the job ends at {end} (in {guard.job_end - time.time():.0f} s); training stops for a "
             f"checkpoint once less than {guard.factor:g} x the last save ({save_s:.1f} s"
             f"{' measured' if measured is not None else ' estimated'}) + a step + {guard.margin_s:g} s is "
             f"left (--signal lead {os.environ.get(signal_lead.LEAD_ENV, '?')} s)")
    return guard
