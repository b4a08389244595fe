"""Distributed checkpoints (megatron.core.dist_checkpointing) with crash-safe publication.

Layout under the checkpoint dir::

    iter_0000010/        a complete checkpoint (model, optimizer, scheduler, step, RNG, data position)
    latest               text file: the name of the newest complete checkpoint

A save writes into ``iter_XXXXXXX.tmp``, renames it to ``iter_XXXXXXX`` once every rank has finished, then
replaces ``latest`` atomically (write ``latest.tmp`` + ``os.replace``). A crash at any point leaves
``latest`` naming a complete checkpoint (or absent), never a partial one.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import List, Optional

import torch

LATEST = "latest"


# Distributed-optimizer state layout. 0.19.2's default (fully_sharded_model_space) builds ShardedTensors
# with flattened_range, which its own validation now rejects; dp_reshardable saves each DP rank's
# contiguous shard (resume needs the same DP size; model weights still reshard freely).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def check_options(checkpoint) -> None:
    """What this writer supports: torch_dist, synchronous saves (validation refuses the rest first)."""
    if checkpoint.format != "torch_dist":
        raise ValueError(f"checkpoint.format={checkpoint.format!r} is not supported; use torch_dist")
    if checkpoint.async_save:
        raise ValueError("checkpoint.async_save=true is not implemented (saves are synchronous); "
                         "use checkpoint.async_save=false")


def _name(step: int) -> str:
    return f"iter_{step:07d}"


def latest_checkpoint(ckpt_dir: Path) -> Optional[Path]:
    """The checkpoint named by ``latest``, if it exists and is complete."""
    marker = Path(ckpt_dir) / LATEST
    if not marker.is_file():
        return None
    path = Path(ckpt_dir) / marker.read_text().strip()
    return path if (path / "metadata.json").is_file() else None


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


def _unwrap(chunk):
    """The GPTModel inside Megatron's DDP wrapper (whose own state dict prefixes keys with 'module.')."""
    return getattr(chunk, "module", chunk)


def _model_keys(model: List[torch.nn.Module]) -> List[str]:
    """State-dict key of each chunk: 'model' without virtual pipeline stages, else 'model0', 'model1', ..."""
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def _sharded_state(model: List[torch.nn.Module], optimizer, scheduler, step: int, consumed: int,
                   is_loading: bool) -> dict:
    state = {"step": step, "consumed_samples": consumed, "scheduler": scheduler.state_dict(),
             "rng_state": _rng_state()}
    model_sd = {key: _unwrap(chunk).sharded_state_dict() for key, chunk in zip(_model_keys(model), model)}
    state.update(model_sd)
    state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIMIZER_METADATA)
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


def save(ckpt_dir: Path, *, model, optimizer, scheduler, step: int, consumed: int, keep_last=None) -> Path:
    """Save collectively (every rank calls), then publish atomically from rank 0."""
    from megatron.core import dist_checkpointing

    sync_params_before_save(model)
    ckpt_dir = Path(ckpt_dir)
    final, tmp = ckpt_dir / _name(step), ckpt_dir / (_name(step) + ".tmp")
    rank = torch.distributed.get_rank()
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    torch.distributed.barrier()
    state = _sharded_state(model, optimizer, scheduler, step, consumed, is_loading=False)
    dist_checkpointing.save(state, str(tmp))
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        marker_tmp = ckpt_dir / (LATEST + ".tmp")
        marker_tmp.write_text(final.name + "\n")
        with open(marker_tmp) as fh:
            os.fsync(fh.fileno())
        os.replace(marker_tmp, ckpt_dir / LATEST)
        _prune(ckpt_dir, keep_last)
    torch.distributed.barrier()
    return final


def _prune(ckpt_dir: Path, keep_last: Optional[int]) -> None:
    if not keep_last:
        return
    done = sorted(p for p in ckpt_dir.glob("iter_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def _materialize_optimizer_state(optimizer) -> None:
    """A fresh torch Adam has no state yet, and DistributedOptimizer.state_dict() (needed to build the load
    template) asserts one common 'step' across its states. Take one step with zero grads and lr=0 (params
    unchanged; weight decay is scaled by lr too) so the state exists; loading then overwrites it."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(opt, DistributedOptimizer) or inner is None or len(inner.state) > 0:
            continue
        saved_lr = [group["lr"] for group in inner.param_groups]
        for group in inner.param_groups:
            group["lr"] = 0.0
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        inner.step()
        inner.zero_grad(set_to_none=True)
        for group, lr in zip(inner.param_groups, saved_lr):
            group["lr"] = lr


def _restore_adam_steps(optimizer, loaded: dict) -> None:
    """Upstream bugs (0.19.2 DistributedOptimizer with torch Adam, no Apex/TE), found by our resume test:
    load_state_dict gives every parameter's Adam state the *same* 'step' tensor (torch then increments it
    once per parameter per step), and the dp_reshardable parameter-state copy then overwrites that tensor
    with the load template's placeholder step. Either way bias correction is wrong after a resume. The
    saved param_groups carry the right step: give each parameter state its own tensor with that value."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    for i, opt in enumerate(chained):
        if not isinstance(opt, DistributedOptimizer):
            continue
        sub = loaded if len(chained) == 1 else loaded[i]
        steps = {float(g["step"]) for g in sub["optimizer"]["param_groups"] if "step" in g}
        if len(steps) != 1:
            continue
        step = steps.pop()
        for st in opt.optimizer.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = torch.tensor(step, dtype=st["step"].dtype, device=st["step"].device)


def load(path: Path, *, model, optimizer, scheduler) -> tuple:
    """Load a checkpoint into model/optimizer/scheduler/RNG; returns (step, consumed_samples)."""
    from megatron.core import dist_checkpointing, tensor_parallel

    _materialize_optimizer_state(optimizer)
    template = _sharded_state(model, optimizer, scheduler, 0, 0, is_loading=True)
    state = dist_checkpointing.load(template, str(path))
    for key, chunk in zip(_model_keys(model), model):
        _unwrap(chunk).load_state_dict(state[key])
    with torch.no_grad():  # fp32 distributed optimizer: main params are views of the (leaf) model params
        optimizer.load_state_dict(state["optimizer"])
    _restore_adam_steps(optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng = state["rng_state"]
    torch.set_rng_state(rng["cpu"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
    if torch.cuda.is_available() and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])
    return int(state["step"]), int(state["consumed_samples"])
