"""Rank entry: ``torchrun --nproc-per-node=N -m launcher.rank --bundle DIR`` (DIR/config.yaml resolved).

parse -> derive the layout -> build (dist, model, optimizer, data) -> resume -> run (log, eval, checkpoint)
-> report -> close. Contract with the job script: a ``DIR/STOP`` file makes every rank checkpoint and exit 0
at the next step; ``DIR/DONE`` is written once all steps have run. Rank 0 prints the clean log; every rank's
full output goes to ``DIR/logs/rank-N.log``. Nothing runs at import time (dist_checkpointing spawns a helper
process that re-imports this module).
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


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
    from launcher.core.checkpoint.directory import checkpoint_dir
    from launcher.core.run_identity import run_hash, run_identity
    from launcher.rank.datasets import DataFilesChanged
    from launcher.rank import elastic, profiling, progress, setup
    from launcher.rank.checkpoint import store as ckpt

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
    from launcher.core.checkpoint.format import checkpoint_format

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
        return _train_locked(_RankRun(bundle, console, job, layout, ckpt_dir, identity, lock, attempt))
    except ckpt.CheckpointError as exc:
        raise RunRefused(str(exc)) from None
    except DataFilesChanged as exc:
        raise RunRefused(str(exc), any_rank=True) from None
    finally:
        lock.release()


@dataclass
class _RankRun:
    """This rank's attempt as ``train`` set it up: the bundle, its console, the job and its layout, the
    checkpoint directory (and the run identity and lock that own it) and the progress record."""

    bundle: Path
    console: Any
    job: Any
    layout: Any
    ckpt_dir: Path
    identity: dict
    lock: Any
    attempt: Any


def _train_locked(run: _RankRun) -> int:
    """Megatron-LM's pretrain order: the model and optimizer (and their checkpoint), the data iterators, train."""
    from launcher.rank import progress, training

    import torch

    t = training.build(run.job, run.layout)
    lp = t.loop
    ckpts = training.Checkpointer(run.job, t, run.ckpt_dir, run.identity, run.console.line)
    ckpts.open()
    run.attempt.update(resumed=lp.step, reached=lp.step)
    progress.STEP[0] = lp.step
    ckpts.preflight()
    cache_dir = run.job.data.cache_dir or str(run.bundle / "data_cache")
    train_iters, valid_iters = t.iterators(cache_dir=cache_dir)  # at lp.consumed: the start, and after a rollback
    torch.distributed.barrier()  # every rank measures the CPU share at the same time
    log = _metrics_logger(run)
    ckpts.open_background()
    ckpts.on_saved = lambda step: run.attempt.update(saved=step)
    ckpts.carried.restore_loaded_rng()  # exactly the saved RNG state at the first step (dropout resumes exactly)
    hooks = _hooks(run, lp, ckpts, log)
    try:
        why = lp.run(train_iters, valid_iters, hooks)
        while why == "spike":  # roll back to the newest checkpoint (all before the spike) and replay from it
            ckpts.rollback()
            train_iters, valid_iters = t.iterators(cache_dir=cache_dir)
            ckpts.carried.restore_loaded_rng()  # as a resume: the checkpoint's RNG streams at the first replayed step
            why = lp.run(train_iters, valid_iters, hooks)
    finally:
        hooks.profiler.close()
    return _finish(run, lp, ckpts, log, why)


def _metrics_logger(run: _RankRun):
    """The run's metrics (console, JSONL, TensorBoard/W&B), utilisation against this rank's peak."""
    from launcher.rank import metrics

    import torch

    job = run.job
    peak, label = metrics.utilisation_basis(peak_tflops_bf16=job.cluster.peak_tflops_bf16,
                                            on_gpu=torch.cuda.is_available(), fp8=job.precision.fp8)
    return metrics.MetricsLogger(logging=job.logging, bundle=run.bundle, run_name=job.name, config=asdict(job),
                                 rank=torch.distributed.get_rank(), console=run.console, peak_tflops=peak,
                                 util_label=label)


def _hooks(run: _RankRun, lp, ckpts, log):
    """What the loop calls out to: the per-step bookkeeping, evaluation, checkpoints, notes and the stops."""
    from launcher.rank import forensics, loop, profiling, progress

    import torch

    def on_step(record):
        forensics.set_step(lp.step)
        log.step(record)
        ckpts.guard.step_took(record["ms_per_step"] / 1e3)
        run.lock.refresh()
        ckpts.poll()  # Megatron-LM: maybe_finalize_async_save(blocking=False) every iteration
        progress.STEP[0] = lp.step
        run.attempt.update(reached=lp.step)

    console, minutes = run.console, run.job.train.exit_after_minutes
    profiler = profiling.StepProfiler.for_job(run.job, run.bundle, torch.distributed.get_rank(),
                                              note=lambda text: console.line(text, all_ranks=True))
    return loop.Hooks(on_step=on_step, on_eval=log.eval, on_checkpoint=ckpts.on_checkpoint, on_note=console.line,
                      stop_check=ckpts.guard.reason, profiler=profiler, stop_file=run.bundle / "STOP",
                      deadline=time.time() + minutes * 60 if minutes else None)


def _finish(run: _RankRun, lp, ckpts, log, why: str) -> int:
    """After the last step: the timeline, the checkpoint in flight, the end save, the summary, DONE or STOPPED."""
    from launcher.rank import metrics, setup
    from launcher.rank.checkpoint import store as ckpt
    from megatron.core import parallel_state as ps

    import torch

    job, layout, console, bundle = run.job, run.layout, run.console, run.bundle
    if lp.recorder is not None and lp.recorder.spans:  # schedule.record_timeline: the last step, drawn
        from launcher.rank.zb_executor import write_timeline

        drawn = write_timeline(lp.recorder, bundle / "timeline", job.schedule.kind)
        if drawn is not None:
            console.line(f"executed timeline of step {lp.step}: {drawn}")
    ckpts.finish_in_flight()  # its steps were good: publish it before judging the end (Megatron-LM's blocking finalize)
    summary = dict(steps=lp.step, world=layout.world, flops_per_token=lp.flops_per_token,
                   peak_tflops=log.peak_tflops, util_label=log.util_label)
    if why == "nonfinite":
        log.close(metrics.summary(log.history, log.evals, status="failed", **summary))
        last = f"the last checkpoint is from step {ckpts.saved_at}" if ckpts.saved_at else "no checkpoint was saved"
        raise ckpt.CheckpointError(f"{lp.stop_reason}: stopping without saving a checkpoint ({last}); "
                                   "lower train.lr, or set train.nonfinite=skip")
    if (job.checkpoint.save_at_end or why == "stopped") and lp.step > ckpts.saved_at:
        ckpts.save()  # synchronous: the run reports done (or stopped) only once it is published
    ckpts.close()
    stages = metrics.memory_by_stage(ps.get_pipeline_model_parallel_rank(), lp.model, lp.optimizer)  # collective
    log.close(metrics.summary(log.history, log.evals, status=why, stages=stages, **summary))
    run.attempt.update(outcome="done" if why == "done" else "stopped")
    if why == "done" and torch.distributed.get_rank() == 0:
        (bundle / "DONE").write_text(f"{lp.step}\n")  # the job script requeues only runs without DONE
    elif torch.distributed.get_rank() == 0:  # launch.sh's final line says why
        (bundle / "STOPPED").write_text(f"at step {lp.step} of {layout.steps}: {lp.stop_reason}\n")
    console.line(f"{'finished' if why == 'done' else 'stopped'} at step {lp.step} of {layout.steps}"
                 f"{' (DONE written)' if why == 'done' else ' (checkpointed; a requeued run resumes)'}")
    setup.close()
    return 0


def _parse(argv):
    parser = argparse.ArgumentParser(prog="launcher.rank", description=__doc__)
    parser.add_argument("--bundle", required=True, help="run bundle directory containing config.yaml")
    return parser.parse_args(argv)
