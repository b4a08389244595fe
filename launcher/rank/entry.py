"""Rank entry: ``torchrun --nproc-per-node=N -m launcher.rank --bundle DIR`` (DIR/config.yaml resolved).

parse -> derive the layout -> build (dist, model, optimizer, data) -> resume -> run (log, eval, checkpoint)
-> report -> close. Contract with the job script: a ``DIR/STOP`` file makes every rank checkpoint and exit 0
at the next step; ``DIR/DONE`` is written once all steps have run. Rank 0 prints the clean log; every rank's
full output goes to ``DIR/logs/rank-N.log``. Nothing runs at import time (dist_checkpointing spawns a helper
process that re-imports this module).
"""
from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import asdict
from pathlib import Path


def main(argv=None) -> int:
    args = _parse(argv)
    bundle = Path(args.bundle)
    from launcher.rank import progress
    from launcher.rank.console import open_rank_log, quiet_known_warnings

    rank = int(os.environ.get("RANK", "0"))
    console, log_path = open_rank_log(bundle, rank)
    quiet_known_warnings()
    from launcher.rank import signals

    signals.STATE.install()  # SIGTERM/SIGINT from here on: checkpoint at the next step boundary, then exit
    try:
        failed = (bundle / "FAILED").read_text().strip() if (bundle / "FAILED").is_file() else None
        if failed:  # a torchrun restart after a refusal every rank agreed on: it would only fail the same way
            print(f"error: {failed} (not retried; said once on the console already)", flush=True)  # rank log
            return 1
        stuck = progress.check(bundle)  # the last two attempts crashed at the same step: a third would too
        if stuck:
            raise RunRefused(stuck)
        return train(bundle, console)
    except RunRefused as exc:  # every rank agrees (checkpoint dir, lock, other run, NaN, no progress): one line
        console.line(f"error: {exc}")
        if rank == 0 or exc.any_rank:
            _write_failed(bundle, f"{exc}\n")
        return 1
    except KeyboardInterrupt:  # only before the handlers above were in place
        return 130
    except Exception as exc:  # a clean non-zero exit: the traceback in the rank log, one line on the console
        import traceback

        traceback.print_exc()
        progress.record_error(bundle, rank, progress.STEP[0], exc)
        console.failure(exc, log_path)
        _snapshot_on_oom(exc, console, rank)
        return 1


def _snapshot_on_oom(exc: BaseException, console, rank: int) -> None:
    """profile.memory_snapshot: the allocator's history at the out-of-memory, into the bundle."""
    from launcher.rank import profiling

    if profiling.SNAPSHOT is not None and profiling.is_out_of_memory(exc):
        path = profiling.SNAPSHOT.dump()
        if path is not None:
            console.line(f"rank {rank}: CUDA memory snapshot at the out-of-memory: {path} (drag it into "
                         "https://pytorch.org/memory_viz)", all_ranks=True)


def _write_failed(bundle: Path, text: str) -> None:
    """FAILED, atomically (any rank may write it: a data error is found by every rank that reads data)."""
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=".FAILED.", dir=bundle)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, bundle / "FAILED")


class RunRefused(Exception):
    """A reason to stop that every rank agrees on; printed as one line by rank 0, not retried by torchrun.
    ``any_rank``: found by some ranks alone (a data file), so whichever finds it writes FAILED."""

    def __init__(self, message: str, any_rank: bool = False):
        super().__init__(message)
        self.any_rank = any_rank


def train(bundle: Path, console) -> int:
    from launcher.core import derive, load_job
    from launcher.core.checkpoint_dir import checkpoint_dir
    from launcher.core.run_identity import run_hash, run_identity
    from launcher.rank.datasets import DataFilesChanged
    from launcher.rank import checkpoint as ckpt, elastic, profiling, progress, setup

    import torch

    job = load_job(bundle / "config.yaml")
    layout, tr = derive(job), job.train
    from launcher.rank import forensics

    # the node's hang watchdog reads where this rank is (launcher/rank/forensics.py); on NCCL the Flight Recorder
    # counts collectives, on gloo these wrappers do
    forensics.install(bundle, int(os.environ.get("RANK", "0")), count_collectives=job.cluster.backend != "nccl")
    if tr.deterministic:  # Megatron-LM's apply_determinism_env(os.environ): before NCCL, cuBLAS or TE read it
        from launcher.core.determinism import accepted_value, apply_env

        for var, value, rule in apply_env(os.environ)[:1]:
            raise RunRefused(f"train.deterministic=true: {var}={value!r} in the ranks' environment (the shell that "
                             f"launched them, or env.sh): {rule}; unset it or export {var}={accepted_value(var)}",
                             any_rank=True)
    elastic.init_process_group_for_restart(job.cluster.backend)  # before setup: a torchrun restart's own keys
    setup.init_distributed(cluster=job.cluster, layout=layout, seed=tr.seed, cuda_graph_impl=tr.cuda_graph_impl)
    if job.cluster.health_check or (job.cluster.health_check is None and job.nodes > 1):
        from launcher.rank import health

        for line in health.probe():
            console.line(line)
    # The checkpoint dir's lock before anything expensive: a second run on the same dir stops in seconds, not
    # after building its model.
    from launcher.core.checkpoint_format import checkpoint_format

    ckpt.check_options(job.checkpoint, checkpoint_format(job))
    ckpt_dir = checkpoint_dir(job.checkpoint.dir, bundle)
    identity = run_identity(job)
    lock = ckpt.DirLock(ckpt_dir, bundle=bundle, run=run_hash(identity))
    try:
        lock.acquire()
        profiling.set_deterministic(tr.deterministic)  # train.deterministic: before any kernel is chosen
        profiling.SNAPSHOT = profiling.MemorySnapshot(enabled=job.profile.memory_snapshot,
                                                      entries=job.profile.memory_snapshot_entries, bundle=bundle,
                                                      rank=torch.distributed.get_rank())
        profiling.SNAPSHOT.start()  # profile.memory_snapshot: the allocator's history from the model build on
        attempt = progress.Attempt(bundle, torch.distributed.get_rank())
        attempt.start()
        return _build_and_train(bundle, console, job, layout, ckpt_dir, identity, lock, attempt)
    except ckpt.CheckpointError as exc:
        raise RunRefused(str(exc)) from None
    except DataFilesChanged as exc:
        raise RunRefused(str(exc), any_rank=True) from None
    finally:
        lock.release()


def build_model_and_optimizer(job, layout) -> tuple:
    """(model chunks, optimizer, LR scheduler) of this rank, built exactly as a production run builds them: the
    backend checks, TP communicator set-up, GPTModel, DDP or Megatron-FSDP wrapper, optimizer, scheduler and the
    model config's hooks. Test workers that need the real objects build through here too."""
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
                         cuda_graph_modules=tr.cuda_graph_modules, cuda_graph_warmup_steps=tr.cuda_graph_warmup_steps)
    model = optim.wrap_ddp(chunks, parallel=job.parallel, precision=job.precision)
    optimizer = optim.build_optimizer(model, train=tr, parallel=job.parallel, precision=job.precision)
    offloaded = optim.host_offload(optimizer) if tr.optimizer_cpu_offload else None
    if offloaded:  # the rank's log says what the offload fraction came to (whole parameters move)
        print(f"optimizer CPU offload: {offloaded[0]:,} of {offloaded[1]:,} elements' Adam state on the host "
              f"({offloaded[0] / max(1, offloaded[1]):.0%}; train.optimizer_offload_fraction="
              f"{tr.optimizer_offload_fraction:g})", flush=True)
    scheduler = optim.build_scheduler(optimizer, train=tr, steps=layout.steps)
    optim.hook_model_config(model, optimizer, parallel=job.parallel)
    return model, optimizer, scheduler


def _build_and_train(bundle, console, job, layout, ckpt_dir, identity, lock, attempt) -> int:
    from launcher.rank import loop

    tr = job.train
    model, optimizer, scheduler = build_model_and_optimizer(job, layout)
    lp = loop.Loop(model=model, optimizer=optimizer, scheduler=scheduler, train=tr, seq_length=job.model.seq_length,
                   num_microbatches=layout.microbatches, kind=job.schedule.kind, dp_size=layout.dp,
                   record_timeline=job.schedule.record_timeline, zb_v_costs=job.schedule.zb_v_costs)
    return _train_locked(bundle, console, job, layout, model, optimizer, scheduler, lp, ckpt_dir, identity, lock,
                         attempt)


def _spike_guard(job, lp, ckpt_dir, latest, console):
    """train.spike_factor: the run's loss-spike rule (launcher/rank/spikes.py), handed to the loop, with the window
    and skips of the checkpoint resumed from; None without the rule."""
    if job.train.spike_factor is None:
        return None
    from launcher.rank import checkpoint as ckpt
    from launcher.rank.spikes import SpikeGuard

    lp.spikes = SpikeGuard(job.train, ckpt_dir, job.schedule.kind, console.line)
    lp.spikes.loaded(ckpt.read_manifest(latest) if latest is not None else None)
    return lp.spikes


def _train_locked(bundle, console, job, layout, model, optimizer, scheduler, lp, ckpt_dir, identity, lock,
                  attempt) -> int:
    from launcher.core import signal_lead
    from launcher.core.checkpoint_dir import checkpoint_name
    from launcher.core.checkpoint_format import checkpoint_format
    from launcher.core.flops import flops_per_token
    from launcher.rank import checkpoint as ckpt, data, forensics, loop, metrics, profiling, progress, setup
    from megatron.core import parallel_state as ps

    import torch

    tr, rank = job.train, torch.distributed.get_rank()
    checksum = job.checkpoint.verify == "checksum"
    latest, carried = None, ckpt.CheckpointState()  # the size estimate and the loaded RNG, from call to call
    if not job.checkpoint.resume:
        moved = ckpt.start_fresh(ckpt_dir, identity)
        if moved:
            console.line(f"checkpoint.resume=false: moved {len(moved)} earlier checkpoint(s) of this run aside "
                         f"(e.g. {moved[0].name})")
    else:
        lp.step, lp.consumed, latest = ckpt.resume(ckpt_dir, identity=identity, load_from=job.checkpoint.load,
                                                   checksum=checksum, model=model, optimizer=optimizer,
                                                   scheduler=scheduler, warn=console.line,
                                                   distributed_optimizer=job.parallel.distributed_optimizer,
                                                   fmt=checkpoint_format(job), run_state=carried)
        if latest is not None:
            console.line(f"resumed from {latest} at step {lp.step} ({lp.consumed} samples consumed)")
    spikes = _spike_guard(job, lp, ckpt_dir, latest, console)
    saved_at = lp.step
    attempt.update(resumed=lp.step, reached=lp.step)
    progress.STEP[0] = lp.step
    need = ckpt.checkpoint_shares(model, distributed_optimizer=job.parallel.distributed_optimizer)
    ckpt.preflight_dir(ckpt_dir, need["total"], run_state=carried)
    guard = _stop_guard(job, latest, need["busiest_node"], console)
    def iterators():  # at lp.consumed: the start, and after a loss-spike rollback
        return data.build_train_valid_iterators(
            data=job.data, model=job.model, train=tr, steps=layout.steps, consumed_samples=lp.consumed,
            dp_rank=ps.get_data_parallel_rank(), dp_size=layout.dp, num_chunks=len(model),
            reads=data.chunks_reading_data(len(model), job.schedule.kind),
            cache_dir=job.data.cache_dir or str(bundle / "data_cache"))

    train_iters, valid_iters = iterators()
    torch.distributed.barrier()  # every rank measures the CPU share at the same time
    peak, label = metrics.utilisation_basis(peak_tflops_bf16=job.cluster.peak_tflops_bf16,
                                            on_gpu=torch.cuda.is_available(), fp8=job.precision.fp8)
    log = metrics.MetricsLogger(logging=job.logging, bundle=bundle, run_name=job.name, config=asdict(job), rank=rank,
                                console=console, peak_tflops=peak, util_label=label)

    # checkpoint.async_save: torch_dist files written in the background (launcher/rank/checkpoint.py AsyncSaves),
    # published when every rank's writer is done; None: every save blocks until published
    from launcher.rank.async_save import AsyncSaves

    background = AsyncSaves() if job.checkpoint.async_save else None

    def published(path, took, step):  # every rank, once the checkpoint of `step` is complete (its manifest written)
        if spikes is not None:
            spikes.saved()
        console.line(f"saved checkpoint {path}")
        attempt.update(saved=step)
        guard.saved(took)
        lead = int(os.environ.get(signal_lead.LEAD_ENV) or job.slurm.signal_lead_s or 0)
        need = guard.needed()
        if os.environ.get("SLURM_JOB_ID") and need > lead:  # USR1 -> the step in flight -> the stop save
            console.line(f"warning: this checkpoint took {took:.0f} s to save; slurm.signal_lead_s={lead} leaves "
                         f"less than {job.slurm.signal_save_factor:g} x that + a step + {job.slurm.signal_margin_s} s "
                         f"before the time limit (training stops by itself {need:.0f} s before it instead): submit "
                         f"with slurm.signal_lead_s={math.ceil(need)} or more, or null to derive it from this save")

    def finish_in_flight():
        """Publish the checkpoint being written in the background, if any (blocking; collective)."""
        if background is not None:
            background.wait()
            guard.in_flight = False

    def save(in_background: bool = False):
        nonlocal saved_at
        finish_in_flight()  # a stop/end save after an async one: that one first (Megatron: one save at a time)
        saved_at, step = lp.step, lp.step
        path = ckpt.save(ckpt_dir, model=model, optimizer=optimizer, scheduler=scheduler, step=lp.step,
                         consumed=lp.consumed, keep_last=job.checkpoint.keep_last, identity=identity,
                         checksum=checksum, optimizer_format=job.checkpoint.optimizer_format,
                         fmt=checkpoint_format(job), run_state=carried,
                         extra={"consumed_samples": lp.consumed,  # the resume plan reads it (resume_plan.py)
                                **({"spikes": spikes.state()} if spikes is not None else {})},
                         background=background if in_background else None,
                         on_published=lambda path, took: published(path, took, step))
        if path is None:  # the writer runs; AsyncSaves.poll publishes it at a later step
            guard.in_flight = True
            console.line(f"writing checkpoint {ckpt_dir / checkpoint_name(step)} in the background "
                         "(checkpoint.async_save)")

    minutes = tr.exit_after_minutes
    fpt = flops_per_token(job.model)

    def on_step(record):
        forensics.set_step(lp.step)
        log.step(record)
        guard.step_took(record["ms_per_step"] / 1e3)
        lock.refresh()
        if background is not None:  # Megatron-LM: maybe_finalize_async_save(blocking=False) every iteration
            background.poll()
            guard.in_flight = background.in_flight()
        progress.STEP[0] = lp.step
        attempt.update(reached=lp.step)

    carried.restore_loaded_rng()  # exactly the saved RNG state at the first step (dropout resumes exactly)
    profiler = profiling.StepProfiler.for_job(job, bundle, rank, note=lambda text: console.line(text, all_ranks=True))
    deadline = time.time() + minutes * 60 if minutes else None

    def run(train_iters, valid_iters) -> str:
        return lp.run(iterators=train_iters, valid_iters=valid_iters, steps=layout.steps, on_step=on_step,
                      on_eval=log.eval, on_checkpoint=lambda: save(in_background=background is not None),
                      save_interval=job.checkpoint.save_interval,
                      flops_per_token=fpt, tokens_per_step=layout.tokens_per_step, world=layout.world,
                      deadline=deadline, stop_file=bundle / "STOP", on_note=console.line, stop_check=guard.reason,
                      profiler=profiler)

    try:
        why = run(train_iters, valid_iters)
        while why == "spike":  # roll back to the newest checkpoint (all before the spike) and replay from it
            finish_in_flight()  # a checkpoint still being written is the newest one to roll back to
            lp.step, lp.consumed, latest = ckpt.resume(  # this run's own newest, else the one it started from
                ckpt_dir, identity=identity, load_from=job.checkpoint.load, checksum=checksum, model=model, optimizer=optimizer,
                scheduler=scheduler, warn=console.line, distributed_optimizer=job.parallel.distributed_optimizer,
                fmt=checkpoint_format(job), run_state=carried)
            spikes.loaded(ckpt.read_manifest(latest) if latest is not None else None)
            console.line(f"rolled back to {latest} (step {lp.step}, {lp.consumed} samples consumed): replaying")
            train_iters, valid_iters = iterators()
            carried.restore_loaded_rng()  # as a resume: the checkpoint's RNG streams at the first replayed step
            why = run(train_iters, valid_iters)
    finally:
        profiler.close()
    if lp.recorder is not None and lp.recorder.spans:  # schedule.record_timeline: the last step, drawn
        from launcher.rank.zero_bubble import write_timeline

        drawn = write_timeline(lp.recorder, bundle / "timeline", job.schedule.kind)
        if drawn is not None:
            console.line(f"executed timeline of step {lp.step}: {drawn}")
    finish_in_flight()  # its steps were good: publish it before judging the end (Megatron-LM's blocking finalize)
    if why == "nonfinite":
        log.close(metrics.summary(log.history, log.evals, status="failed", steps=lp.step, world=layout.world,
                                  flops_per_token=fpt, peak_tflops=peak, util_label=label))
        last = f"the last checkpoint is from step {saved_at}" if saved_at else "no checkpoint was saved"
        raise ckpt.CheckpointError(f"{lp.stop_reason}: stopping without saving a checkpoint ({last}); "
                                   "lower train.lr, or set train.nonfinite=skip")
    if (job.checkpoint.save_at_end or why == "stopped") and lp.step > saved_at:
        save()  # synchronous: the run reports done (or stopped) only once it is published
    if background is not None:
        background.close()
    stages = metrics.memory_by_stage(ps.get_pipeline_model_parallel_rank(), model, optimizer)  # collective
    log.close(metrics.summary(log.history, log.evals, status=why, steps=lp.step, world=layout.world,
                              flops_per_token=fpt, peak_tflops=peak, util_label=label, stages=stages))
    attempt.update(outcome="done" if why == "done" else "stopped")
    if why == "done" and rank == 0:
        (bundle / "DONE").write_text(f"{lp.step}\n")  # the job script requeues only runs without DONE
    elif rank == 0:  # launch.sh's final line says why
        (bundle / "STOPPED").write_text(f"at step {lp.step} of {layout.steps}: {lp.stop_reason}\n")
    console.line(f"{'finished' if why == 'done' else 'stopped'} at step {lp.step} of {layout.steps}"
                 f"{' (DONE written)' if why == 'done' else ' (checkpointed; a requeued run resumes)'}")
    setup.close()
    return 0


def _stop_guard(job, resumed, node_bytes: int, console):
    """Stop in time for the Slurm time limit on every attempt (launcher/core/signal_lead.py): the job's end
    time from job.sbatch, this run's save time (the resumed checkpoint's measured one, else the estimate: the
    bytes the busiest node writes under fully parallel save over one node's write bandwidth)."""
    from launcher.core import checkpoint_dir as cdir, signal_lead

    measured = (cdir.read_manifest(Path(resumed)) or {}).get("save_seconds") if resumed is not None else None
    save_s = (float(measured) if isinstance(measured, (int, float)) else
              cdir.node_save_s(node_bytes, write_gbps=job.cluster.checkpoint_write_gbps))
    guard = signal_lead.StopGuard(signal_lead.job_end_from_env(), save_s=save_s, factor=job.slurm.signal_save_factor,
                                  margin_s=job.slurm.signal_margin_s)
    if guard.job_end is not None:
        end = time.strftime("%H:%M:%S UTC", time.gmtime(guard.job_end))
        console.line(f"slurm: the job ends at {end} (in {guard.job_end - time.time():.0f} s); training stops for a "
                     f"checkpoint once less than {guard.factor:g} x the last save ({save_s:.1f} s"
                     f"{' measured' if measured is not None else ' estimated'}) + a step + {guard.margin_s:g} s is "
                     f"left (--signal lead {os.environ.get(signal_lead.LEAD_ENV, '?')} s)")
    return guard


def _parse(argv):
    parser = argparse.ArgumentParser(prog="launcher.rank", description=__doc__)
    parser.add_argument("--bundle", required=True, help="run bundle directory containing config.yaml")
    return parser.parse_args(argv)
