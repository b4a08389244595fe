"""Distributed checkpoints (megatron.core.dist_checkpointing) you can trust: complete-only, verified, owned.

This module is what needs torch: Megatron's save and load (torch_dist here, fsdp_dtensor in
``fsdp_checkpoint.py``, the other format converted by ``checkpoint_convert.py``, the distributed optimizer's
state through ``optimizer_state.py``), the RNG states, the collectives that make every rank agree, and the
directory lock. The directory's files (where it is, what counts as complete, how big a checkpoint is, publishing,
verifying, pruning, choosing what to resume from) are plain file operations in the torch-free
``launcher/core/checkpoint/directory.py``, which the login node reads too; the run's identity is
``launcher/core/run_identity.py``. Layout under the checkpoint dir::

    iter_0000010/        a complete checkpoint: dist_checkpointing files + launcher.json (written last)
    latest               text file: the name of the newest complete checkpoint (informational; resume scans)
    LOCK                 the run that uses this dir now (host, pid, Slurm job, run hash); refreshed while training

A save writes into ``iter_XXXXXXX.tmp``; once every rank has finished, rank 0 writes ``launcher.json`` (step,
the run's identity and hash, every file's size and optionally CRC32), renames the directory to
``iter_XXXXXXX`` and replaces ``latest`` atomically. Only a directory with ``launcher.json`` counts as a
checkpoint, so a crash at any point leaves at most an ignored partial directory.

Resume (``resume``): rank 0 lists this run's complete checkpoints newest first and broadcasts the list; every
rank verifies its share of the files, then all load together; on any failure every rank warns naming the
directory and falls back to the previous one. Existing checkpoints that cannot be loaded, or that belong to a
different run (another config hash), stop the run with one line instead of being overwritten, unless
``checkpoint.resume=false`` (start fresh: this run's old checkpoints are moved aside) or ``checkpoint.load=``.
"""
from __future__ import annotations

import datetime
import errno
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import torch

from launcher.core.checkpoint import dirlock
from launcher.core.checkpoint.directory import (bytes_per_param, checkpoint_name, complete_checkpoints, dir_error,
                                          is_dcp_only, mentions_enospc, own_crcs, plan_resume, prune, publish,
                                          read_manifest, set_aside, space_problem, verify_files, write_probe)
from launcher.core.run_identity import identity_diff, run_hash
from launcher.core.checkpoint.weights import continue_hint, weights_mismatch
from launcher.rank.checkpoint import convert as checkpoint_convert
from launcher.rank.checkpoint import fsdp as fsdp_checkpoint
from launcher.rank.checkpoint.optimizer_state import (cpu_tensors_stay, materialize_optimizer_state, restore_adam_steps,
                                           tolerate_missing_adam_step)
from models.backend import compute_device

LOCK = "LOCK"
LOCK_STALE_S = 600
"""A lock whose owner is on another host and has not refreshed it for this long is stale (its node died)."""
LOCK_REFRESH_S = 30


class CheckpointError(Exception):
    """A checkpoint problem every rank agrees on: the run stops with this one line (no traceback)."""


# Distributed-optimizer state layout (checkpoint.optimizer_format). 0.19.2's default
# (fully_sharded_model_space) builds ShardedTensors with flattened_range, which its own validation now
# rejects. dp_reshardable saves each DP rank's contiguous shard (resume needs the same DP size; model weights
# still reshard freely); fully_reshardable gathers each model-parallel shard's state on DP rank 0 and loads at
# any DP size. The format a checkpoint was saved with is recorded in its manifest and used to load it.
DEFAULT_OPTIMIZER_FORMAT = "dp_reshardable"


TORCH_DIST = "torch_dist"
"""The format of a checkpoint whose manifest names none (written before fsdp_dtensor existed here)."""


def check_options(checkpoint, fmt: str = TORCH_DIST) -> None:
    """What this writer supports: torch_dist (fsdp_dtensor under parallel.megatron_fsdp: launcher/core/
    checkpoint_format.py); asynchronous saves of torch_dist only (validation refuses the rest first)."""
    if checkpoint.format != "torch_dist":
        raise ValueError(f"checkpoint.format={checkpoint.format!r} is not supported; use torch_dist")
    if checkpoint.async_save and fmt != TORCH_DIST:
        raise ValueError(f"checkpoint.async_save=true writes torch_dist only, this job writes {fmt}; "
                         "use checkpoint.async_save=false")


# ---- collectives -------------------------------------------------------------------------------------------

def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _broadcast(obj):
    """rank 0's object on every rank."""
    if _world() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj) -> list:
    """Every rank's object, on every rank."""
    if _world() == 1:
        return [obj]
    out = [None] * _world()
    torch.distributed.all_gather_object(out, obj)
    return out


def agree_or_raise(message: Optional[str]) -> None:
    """Collective: if any rank has a message, every rank raises CheckpointError with the first one."""
    messages = [m for m in _gather(message) if m]
    if messages:
        raise CheckpointError(messages[0])


def agree_loaded(error: Optional[str]) -> Optional[str]:
    """Collective, right after every rank's load attempt: all ranks learn whether all of them loaded.

    dist_checkpointing reads each shard inside the rank's own data-parallel group only, so a damaged shard of
    one TP/PP rank fails there alone while the others load fine; without this they would go on to the next
    collective and wait for the failed rank until the process-group timeout (10 min). Each rank contributes a
    success flag (all_reduce MIN over the world group: one tensor on the backend's device, gloo or NCCL); only
    when it is 0 are the messages gathered, so every rank returns the same first error and falls back (or
    stops) together."""
    if _world() == 1:
        return error
    flag = torch.tensor([0.0 if error else 1.0], dtype=torch.float64,
                        device=compute_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    if flag.item() == 1.0:
        return None
    errors = [f"rank {r}: {e}" for r, e in enumerate(_gather(error)) if e]
    return errors[0]


# ---- lock --------------------------------------------------------------------------------------------------

def _lock_owner(bundle: Path, run: str) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID", ""),
            "bundle": str(bundle), "run": run, "token": uuid.uuid4().hex,
            "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def lock_is_stale(owner: dict, age_s: float) -> bool:
    """Ours to take (``launcher.core.checkpoint.dirlock.owner_gone``): its process is gone (same host), it is this Slurm job
    (a requeue or torchrun restart), or it was not refreshed for LOCK_STALE_S (its node is gone)."""
    return dirlock.owner_gone(owner, age_s, stale_s=LOCK_STALE_S)


class DirLock:
    """Exclusive use of a checkpoint dir by one run (rank 0 holds it; ``acquire`` is collective). The file
    protocol (atomic create-with-owner, guarded takeover of a stale lock) is ``launcher.core.checkpoint.dirlock``."""

    def __init__(self, ckpt_dir: Path, *, bundle: Path, run: str):
        self.path, self.owner = Path(ckpt_dir) / LOCK, _lock_owner(bundle, run)
        self.held, self._touched = False, 0.0

    def _try(self) -> Optional[str]:
        holder = dirlock.take(self.path, self.owner, lock_is_stale)
        if holder is None:
            self.held, self._touched = True, time.time()
            return None
        if not holder:
            return (f"checkpoint.dir={self.path.parent} is being taken by another run right now ({self.path} is "
                    "still being written); use another checkpoint.dir, or start this run once that one stops")
        where = f"job {holder['job']}" if holder.get("job") else f"pid {holder.get('pid')} on {holder.get('host')}"
        return (f"checkpoint.dir={self.path.parent} is in use by another run ({where}, bundle "
                f"{holder.get('bundle')}, since {holder.get('since')}); use another checkpoint.dir")

    def acquire(self) -> None:
        message = None
        if _rank() == 0:
            try:
                message = self._try()
            except OSError as exc:
                message = dir_error(self.path.parent, exc)
        agree_or_raise(message)

    def refresh(self) -> None:
        if self.held and time.time() - self._touched > LOCK_REFRESH_S:
            try:
                os.utime(self.path)
            except OSError:
                pass
            self._touched = time.time()

    def release(self) -> None:
        if self.held:
            dirlock.release(self.path, self.owner)
            self.held = False


# ---- space -------------------------------------------------------------------------------------------------

def _param_bytes(param) -> int:
    """One parameter's bytes in a checkpoint (launcher/core/checkpoint/directory.py bytes_per_param)."""
    return param.numel() * bytes_per_param(param.element_size(), fp32=param.dtype == torch.float32)


def _written_here(model) -> float:
    """The bytes this rank writes under fully parallel save (``save_strategy``): a replicated shard is split
    evenly over the ranks holding a replica, i.e. over the DP (with CP) group for dense parameters and the
    expert-DP group for expert parameters (Megatron marks those ``allreduce=False``,
    megatron/core/distributed/distributed_data_parallel.py); the distributed optimizer's DP shards come to
    the same share."""
    from megatron.core import parallel_state

    dense = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    expert = parallel_state.get_expert_data_parallel_world_size()
    return float(sum(_param_bytes(p) / (dense if getattr(p, "allreduce", True) else expert)
                     for chunk in model for p in chunk.parameters()))


def checkpoint_shares(model, *, distributed_optimizer: bool, ranks_per_node: Optional[int] = None) -> dict:
    """About how many bytes one checkpoint of this model takes, counted shard by shard (collective): ``total`` (every shard once, for the disk check)
    and ``busiest_node`` (what the node that writes most writes, for the save time). Each rank's share is
    ``_written_here``; one all-reduce of a world-sized vector on the compute device gives every rank all
    shares. torchrun numbers ranks node by node (``ranks_per_node``, default LOCAL_WORLD_SIZE)."""
    world, rank = _world(), _rank()
    per_rank = torch.zeros(world, dtype=torch.float64, device=compute_device())
    per_rank[rank] = _written_here(model)
    if world > 1:
        torch.distributed.all_reduce(per_rank)
    shares = per_rank.cpu().tolist()
    per_node = max(1, min(world, ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE") or world)))
    nodes = [sum(shares[i:i + per_node]) for i in range(0, world, per_node)]
    return {"total": int(round(sum(shares))), "busiest_node": int(round(max(nodes))), "nodes": len(nodes)}


def save_strategy():
    """Megatron-LM's default save: the torch_dist strategy wrapped in FullyParallelSaveStrategyWrapper over the
    data-parallel group with context parallelism (megatron/training/checkpointing.py save_checkpoint,
    ``if args.ckpt_fully_parallel_save: ... FullyParallelSaveStrategyWrapper(save_strategy, process_group,
    args.ckpt_assume_constant_structure)``; ``fully_parallel_save`` defaults to True in
    megatron/training/config/training_config.py). Every DP replica writes an even share of the replicated
    shards instead of DP rank 0 writing all of them. Only metadata is exchanged (all_gather_object), no
    tensors. Loading stays the plain torch_dist strategy, as Megatron-LM's default (``fully_parallel_load``
    defaults to False there; its FullyParallelLoadStrategyWrapper allocates on "cuda",
    megatron/core/dist_checkpointing/exchange_utils.py)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    from launcher.rank.signals import writer_results_queue

    writer_results_queue()  # a helper that outlives stop signals (the stop save needs it)
    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"),
                                            parallel_state.get_data_parallel_group(with_context_parallel=True),
                                            False)  # ckpt_assume_constant_structure's default


class CheckpointState:
    """What one run's checkpoint calls hand on to each other: the size of one checkpoint estimated before step 1
    (with its margin; ``preflight_dir`` -> ``save``, to recognise a full disk) and the RNG state of the checkpoint
    loaded last (``load`` -> ``restore_loaded_rng``, just before the first step). The entry makes one per run."""

    def __init__(self):
        self.need_bytes = 0
        self.loaded_rng = None

    def restore_loaded_rng(self) -> None:
        """Re-apply the RNG state of the checkpoint loaded last, as the very last thing before the first step:
        whatever ran after the load (the CPU-share benchmark, data set-up) may have drawn from the generators,
        which the uninterrupted run did before step 1 instead (a dropout resume then diverged)."""
        if self.loaded_rng is not None:
            snapshot, self.loaded_rng = self.loaded_rng, None
            _rng_restore(snapshot)


def preflight_dir(ckpt_dir: Path, need_bytes: int, run_state: Optional[CheckpointState] = None) -> None:
    """Collective, before step 1: rank 0 creates ckpt_dir, writes and removes a probe file in it and checks free
    space for one more checkpoint (disk full or read-only fails now, not at the first save hours later)."""
    message = None
    if _rank() == 0:
        need_bytes = int(need_bytes * 1.2)  # the estimate was 7% under a real TINY checkpoint (3.57 MB)
        if run_state is not None:
            run_state.need_bytes = need_bytes
        try:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            why = write_probe(ckpt_dir) or space_problem(ckpt_dir, need_bytes)
            message = f"checkpoint.dir={ckpt_dir}: {why}" if why else None
        except OSError as exc:
            message = dir_error(ckpt_dir, exc)
    agree_or_raise(message)


def _rng_state():
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {"cpu": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    pp, tp, dp = (parallel_state.get_pipeline_model_parallel_rank(),
                  parallel_state.get_tensor_model_parallel_rank(),
                  parallel_state.get_data_parallel_rank(with_context_parallel=True))
    shape = (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size(),
             parallel_state.get_data_parallel_world_size(with_context_parallel=True))
    return ShardedObject("rng_state", state, shape, (pp, tp, dp), replica_id=0)


def _rng_restore(snapshot) -> None:
    """Set the CPU generator, the model-parallel tracker's named states and (on GPU) the CUDA generator."""
    from megatron.core import tensor_parallel

    cpu, tracker, cuda = snapshot
    torch.set_rng_state(cpu)
    tensor_parallel.get_cuda_rng_tracker().set_states(tracker)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def _unwrap(chunk):
    """The GPTModel inside Megatron's DDP wrapper (whose own state dict prefixes keys with 'module.')."""
    return getattr(chunk, "module", chunk)


def _model_keys(model: List[torch.nn.Module]) -> List[str]:
    """State-dict key of each chunk: 'model' without virtual pipeline stages, else 'model0', 'model1', ..."""
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def _sharded_state(model: List[torch.nn.Module], optimizer, scheduler, step: int, consumed: int,
                   is_loading: bool, optimizer_format: str = DEFAULT_OPTIMIZER_FORMAT) -> dict:
    state = {"step": step, "consumed_samples": consumed, "scheduler": scheduler.state_dict(),
             "rng_state": _rng_state()}
    model_sd = {key: _unwrap(chunk).sharded_state_dict() for key, chunk in zip(_model_keys(model), model)}
    state.update(model_sd)
    with cpu_tensors_stay():
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                          metadata={"distrib_optim_sharding_type": optimizer_format})
    return state


def sync_params_before_save(model: List[torch.nn.Module]) -> bool:
    """Finish the distributed optimizer's deferred parameter all-gather now; True when it ran.

    With ``overlap_param_gather`` the all-gather of the parameters updated by ``optimizer.step()`` is
    dispatched in the next forward, so a save right after a step would write shards a step old.
    Megatron-Bridge forces the same synchronous sync before saving."""
    deferred = any(getattr(getattr(chunk, "ddp_config", None), "overlap_param_gather", False) for chunk in model)
    if deferred:
        for chunk in model:
            chunk.start_param_sync(force_sync=True)
    return deferred


def save(ckpt_dir: Path, *, model, optimizer, scheduler, step: int, consumed: int, keep_last=None,
         identity: Optional[dict] = None, checksum: bool = False,
         optimizer_format: str = DEFAULT_OPTIMIZER_FORMAT, fmt: str = TORCH_DIST,
         run_state: Optional[CheckpointState] = None, extra: Optional[dict] = None,
         background=None, on_published: Optional[Callable[[Path, float], None]] = None
         ) -> Optional[Path]:
    """Save collectively (every rank calls), then publish atomically from rank 0; returns the checkpoint.
    ``fmt``: torch_dist (dist_checkpointing) or fsdp_dtensor (Megatron-FSDP: launcher/rank/checkpoint/fsdp.py).
    ``extra``: more run state for the manifest (``publish``).

    ``background`` (checkpoint.async_save, torch_dist: a ``launcher.rank.checkpoint.async_save.AsyncSaves``): the files are
    written by its writer process
    while training goes on, and this returns None once the write has started; the checkpoint is published later,
    when ``AsyncSaves.poll``/``wait`` finalizes it, which then calls ``on_published(path, seconds)``.

    Never replaces a complete checkpoint of another run. A failed write (disk full, I/O error) raises
    CheckpointError on every rank and publishes nothing."""
    from megatron.core import dist_checkpointing

    identity = identity or {}
    if background is not None:  # at most one in flight: a new save waits for the previous one to be published
        background.wait()
    sync_params_before_save(model)
    ckpt_dir = Path(ckpt_dir)
    final, tmp = ckpt_dir / checkpoint_name(step), ckpt_dir / (checkpoint_name(step) + ".tmp")
    rank, message = _rank(), None
    if rank == 0:
        theirs = read_manifest(final)
        if theirs is not None and theirs.get("run") != run_hash(identity):
            message = (f"{final} is a checkpoint of another run ({identity_diff(theirs.get('identity', {}), identity)});"
                       " not overwriting it: use another checkpoint.dir")
        else:
            try:
                ckpt_dir.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            except OSError as exc:
                message = dir_error(ckpt_dir, exc)
    agree_or_raise(message)
    start = time.perf_counter()
    publish_args = dict(step=step, identity=identity, optimizer_format=optimizer_format, fmt=fmt, extra=extra,
                        keep_last=keep_last)
    if background is not None:
        background.start(model=model, optimizer=optimizer, scheduler=scheduler, consumed=consumed, tmp=tmp,
                         final=final, ckpt_dir=ckpt_dir, checksum=checksum, run_state=run_state, started=start,
                         on_published=on_published, publish_args=publish_args)
        return None
    try:
        if fmt == fsdp_checkpoint.FORMAT:
            fsdp_checkpoint.save(tmp, model=model, optimizer=optimizer, scheduler=scheduler, step=step,
                                 consumed=consumed)
        else:
            state = _sharded_state(model, optimizer, scheduler, step, consumed, is_loading=False,
                                   optimizer_format=optimizer_format)
            dist_checkpointing.save(state, str(tmp), save_strategy())
        message, crcs = None, own_crcs(tmp, checksum=checksum, rank=rank)
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        # every rank reaches the agreement below (dist_checkpointing reports write failures collectively)
        message, crcs = _failed_save(exc, final, ckpt_dir, run_state), {}
    _publish_agreed(ckpt_dir, tmp, final, message, crcs, seconds=time.perf_counter() - start, **publish_args)
    if on_published is not None:
        on_published(final, time.perf_counter() - start)
    return final


def _failed_save(exc: BaseException, final: Path, ckpt_dir: Path, run_state: Optional[CheckpointState]) -> str:
    """The one line for a failed write (disk full, I/O error), on the rank that saw it. A full disk shows up as an
    opaque worker error ("unexpected pos ..."): judge by the free space."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        raise exc
    message = f"saving {final} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    free = shutil.disk_usage(ckpt_dir).free if _rank() == 0 else None
    need = run_state.need_bytes if run_state is not None else 0
    if mentions_enospc(exc) or (free is not None and free < max(need, 1 << 20)):
        message = (f"saving {final} failed: no space left on device in checkpoint.dir={ckpt_dir} "
                   f"({free / 1e9:.3g} GB free, a checkpoint needs about {need / 1e9:.3g} GB)")
    return message


def _publish_agreed(ckpt_dir: Path, tmp: Path, final: Path, message: Optional[str], crcs: dict, *, step: int,
                    identity: dict, seconds: float, optimizer_format: str, fmt: str, extra: Optional[dict],
                    keep_last) -> None:
    """Collective, once every rank has written its files into ``tmp`` (or failed: ``message``): rank 0 writes the
    manifest last and renames (``publish``), then prunes; any rank's failure raises CheckpointError everywhere and
    publishes nothing. Pruning runs only here, after the new checkpoint is complete: an in-flight one is never
    counted, so the newest complete one is never removed."""
    rank = _rank()
    all_crcs = _gather(crcs)
    if message is None and rank == 0:
        try:
            publish(ckpt_dir, tmp, final, step=step, identity=identity, crcs=all_crcs, seconds=seconds,
                    rng=rng_layout(), optimizer_format=optimizer_format, fmt=fmt, extra=extra)
            prune(ckpt_dir, keep_last, run_hash(identity))
        except OSError as exc:
            message = (f"publishing {final} failed: no space left on device" if exc.errno == errno.ENOSPC
                       else f"publishing {final} failed: {exc}")
    if message is not None and rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    agree_or_raise(message)


def start_fresh(ckpt_dir: Path, identity: dict) -> List[Path]:
    """Collective, for checkpoint.resume=false: refuse a dir holding another run's complete checkpoints (the new
    run would overwrite them step by step), else set this run's old ones aside (rank 0) and return them."""
    message, moved = None, []
    if _rank() == 0:
        run = run_hash(identity)
        foreign = [(p, m) for p, m in complete_checkpoints(ckpt_dir) if m.get("run") != run]
        if foreign:
            path, manifest = foreign[0]
            message = (f"checkpoint.dir={ckpt_dir} holds checkpoints of another run ({path.name}: "
                       f"{identity_diff(manifest.get('identity', {}), identity)}); checkpoint.resume=false would "
                       "overwrite them: use another checkpoint.dir")
        else:
            try:
                moved = [str(p) for p in set_aside(ckpt_dir, run)]
            except OSError as exc:
                message = dir_error(Path(ckpt_dir), exc)
    agree_or_raise(message)
    return [Path(p) for p in _broadcast(moved)]


def resume(ckpt_dir: Path, *, identity: dict, load_from: Optional[str], checksum: bool, model, optimizer,
           scheduler, warn: Callable[[str], None], distributed_optimizer: bool = False, fmt: str = TORCH_DIST,
           run_state: Optional[CheckpointState] = None) -> Tuple[int, int, Optional[Path]]:
    """Collective: load the newest loadable checkpoint; returns (step, consumed samples, its path or None).
    The loaded RNG state is kept in ``run_state`` for ``CheckpointState.restore_loaded_rng``.

    Each candidate is verified (every rank checks its share of the files), then loaded by all ranks; a failure
    anywhere makes every rank warn and try the previous one. Existing checkpoints of which none loads stop the
    run (CheckpointError) rather than letting it start fresh over them."""
    plan = _broadcast(plan_resume(Path(ckpt_dir), identity, load_from) if _rank() == 0 else None)
    if "error" in plan:
        raise CheckpointError(plan["error"])
    tried = []
    for path_s, manifest in plan["candidates"]:
        path = Path(path_s)
        problems = [p for share in _gather(verify_files(path, manifest, checksum=checksum, rank=_rank(),
                                                        world=_world())) for p in share]
        error = f"{len(problems)} damaged file(s): {'; '.join(problems[:3])}" if problems else None
        weights_only = bool(manifest.get("weights_only"))  # `import-hf`: model weights, no optimizer/step/RNG
        if error is None and plan["source"] == "load":
            error = weights_mismatch(manifest, identity)
            if error is not None:  # the same model entry on every rank: nothing to fall back to
                hint = continue_hint(manifest, identity)
                raise CheckpointError(f"checkpoint.load={path}: {error}; name a checkpoint of this model"
                                      + (f", or set {hint}" if hint else ""))
        with_rng = manifest.get("rng_layout") == rng_layout()  # unknown (no manifest): not restored
        opt_fmt = manifest.get("optimizer_format", DEFAULT_OPTIMIZER_FORMAT)
        saved_dp = (manifest.get("rng_layout") or [None] * 3)[2]
        saved_fmt = manifest.get("format") or (fsdp_checkpoint.FORMAT if is_dcp_only(path) else TORCH_DIST)
        if error is None and saved_fmt != fmt:  # converted on the ranks where it can be (checkpoint_convert)
            refused = checkpoint_convert.refusal(path, manifest, saved_fmt, identity)
            if refused:  # the same job cannot read it: nothing to fall back to
                raise CheckpointError(refused)
            opt_fmt = "fully_reshardable"  # the per-parameter torch_dist template the converted state fills
        if (error is None and distributed_optimizer and fmt == TORCH_DIST and opt_fmt == "dp_reshardable"
                and saved_dp not in (None, rng_layout()[2])):
            error = (f"its distributed-optimizer state was saved with checkpoint.optimizer_format=dp_reshardable at "
                     f"DP={saved_dp}, this run has DP={rng_layout()[2]}; resume at DP={saved_dp}, or save with "
                     "checkpoint.optimizer_format=fully_reshardable")
        if not with_rng and manifest.get("rng_layout"):
            warn(f"note: {path} was saved at (PP, TP, DP) = {tuple(manifest['rng_layout'])}, this run is "
                 f"{tuple(rng_layout())}: weights and optimizer are resharded, the RNG streams start afresh")
        if error is None:
            try:
                step, consumed = load(path, model=model, optimizer=optimizer, scheduler=scheduler,
                                      with_rng=with_rng, optimizer_format=opt_fmt, weights_only=weights_only,
                                      fmt=fmt, saved_fmt=saved_fmt, run_state=run_state)
            except BaseException as exc:  # noqa: BLE001 - any load failure means: try the previous checkpoint
                # (torch.distributed.checkpoint's CheckpointException is a BaseException: caught by `except
                # Exception`, the rank whose shard was bad died while the others waited for it)
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                import traceback

                traceback.print_exc()  # into this rank's log; the console gets the one-line warning
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            error = agree_loaded(error)
        if error is None:
            return step, consumed, path
        tried.append(path.name)
        warn(f"warning: checkpoint {path} could not be loaded ({error}); falling back to the previous one")
    if tried and plan["source"] == "load":  # not this run's own: nothing to fix or remove in checkpoint.dir
        raise CheckpointError(f"checkpoint.load={load_from}: could not be loaded into this run (tried "
                              f"{', '.join(tried)}; last error: {error}); it is damaged or holds tensors this model "
                              "does not have: name a healthy checkpoint of this model, or unset checkpoint.load")
    if tried:
        raise CheckpointError(f"no checkpoint in {Path(plan['candidates'][0][0]).parent} could be loaded (tried "
                              f"{', '.join(tried)}); fix or remove them, or set checkpoint.resume=false to start fresh")
    return 0, 0, None


def rng_layout() -> list:
    """(PP, TP, DP) sizes: the shape of the per-rank RNG states in a checkpoint."""
    from megatron.core import parallel_state

    return [parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_data_parallel_world_size(with_context_parallel=True)]


def load(path: Path, *, model, optimizer, scheduler, with_rng: bool = True,
         optimizer_format: str = DEFAULT_OPTIMIZER_FORMAT, weights_only: bool = False, fmt: str = TORCH_DIST,
         saved_fmt: Optional[str] = None, run_state: Optional[CheckpointState] = None) -> tuple:
    """Load a checkpoint into model/optimizer/scheduler/RNG; returns (step, consumed_samples). A weights-only
    checkpoint (``import-hf``) loads the model's weights alone and starts at step 0 (Megatron-LM's --finetune with
    --no-load-optim --no-load-rng): the optimizer's fp32 main parameters are copied from the loaded weights."""
    from megatron.core import dist_checkpointing, tensor_parallel

    if weights_only:
        for chunk in model:  # each virtual stage's chunk reads its own tensors (the keys are global)
            state = dist_checkpointing.load({"model": _unwrap(chunk).sharded_state_dict()}, str(path))
            _unwrap(chunk).load_state_dict(state["model"])
        # bf16/fp16: the optimizer's fp32 main parameters were copied from the initial weights when it was built;
        # Megatron-LM's load_checkpoint calls the same after a --no-load-optim load (megatron/training/checkpointing.py)
        if hasattr(optimizer, "reload_model_params"):
            optimizer.reload_model_params()
        return 0, 0
    converted = None  # a checkpoint of the other format (saved_fmt), streamed into this rank's template
    if saved_fmt not in (None, fmt):
        converted = checkpoint_convert.read(path, saved_fmt, model)
    if fmt == fsdp_checkpoint.FORMAT:
        step, consumed, snapshot = fsdp_checkpoint.load(path, model=model, optimizer=optimizer, scheduler=scheduler,
                                                        with_rng=with_rng, converted=converted)
        if snapshot is not None:
            if run_state is not None:
                run_state.loaded_rng = snapshot
            _rng_restore(snapshot)
        return step, consumed
    materialize_optimizer_state(optimizer)
    tolerate_missing_adam_step()
    template = _sharded_state(model, optimizer, scheduler, 0, 0, is_loading=True, optimizer_format=optimizer_format)
    if not with_rng:  # saved per (PP, TP, DP) rank: another layout has no shard for this rank
        template.pop("rng_state")
    state = (dist_checkpointing.load(template, str(path)) if converted is None else
             checkpoint_convert.torch_dist_state(template, converted, checkpoint_convert.keys_map_of(model)))
    for key, chunk in zip(_model_keys(model), model):
        _unwrap(chunk).load_state_dict(state[key])
    with torch.no_grad(), cpu_tensors_stay():  # fp32 dist. optimizer: main params are views of the model's
        optimizer.load_state_dict(state["optimizer"])
    restore_adam_steps(optimizer, state["optimizer"])
    # Megatron's OptimizerParamScheduler.load_state_dict *adds* the saved num_steps (step(increment=...)): after
    # a fallback (a newer checkpoint loaded on some ranks, failed on others) those ranks would count both.
    if hasattr(scheduler, "num_steps"):
        scheduler.num_steps = 0
    scheduler.load_state_dict(state["scheduler"])
    if with_rng:
        rng = state["rng_state"]
        snapshot = (rng["cpu"], rng["tracker"], rng.get("cuda") if torch.cuda.is_available() else None)
        if run_state is not None:
            run_state.loaded_rng = snapshot
        _rng_restore(snapshot)
    return int(state["step"]), int(state["consumed_samples"])
