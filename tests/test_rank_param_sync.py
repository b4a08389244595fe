"""The pipeline schedule's sync hooks, set as Megatron-LM's training.py sets them: with virtual pipelines and the
distributed optimizer's overlapped parameter all-gather, DDP aligns the all-gathers (``align_param_gather``) and the
interleaved schedule dispatches each chunk's through ``config.param_sync_func`` (one ``start_param_sync`` per
chunk); the gradient-reduce hooks under overlap_grad_reduce. Overlap needs CUDA streams, so the DDP wrappers are
stand-ins and the DDP config is the one a GPU rank builds (``on_gpu=True``)."""
from __future__ import annotations

import types

import pytest

from launcher.config import compose_job
from launcher.rank import optim


class _Chunk:
    def __init__(self, ddp_config, config):
        self.ddp_config, self.config = ddp_config, config

    def no_sync(self):
        pass

    def start_grad_sync(self):
        pass

    def start_param_sync(self, *a, **k):
        pass


def _hooked(overrides):
    job = compose_job(["recipe=smoke", *overrides])
    ddp = optim.ddp_config(parallel=job.parallel, precision=job.precision, on_gpu=True)
    config = types.SimpleNamespace(finalize_model_grads_func=None, grad_scale_func=None, no_sync_func=None,
                                   grad_sync_func=None, param_sync_func=None)
    chunks = [_Chunk(ddp, config) for _ in range(job.parallel.virtual_pipeline or 1)]
    optim.hook_model_config(chunks, types.SimpleNamespace(scale_loss=lambda x: x), parallel=job.parallel)
    return ddp, config, chunks


VPP = ["parallel.pipeline=2", "parallel.virtual_pipeline=2", "schedule.kind=interleaved"]


def test_virtual_pipelines_align_the_param_gather_per_chunk():
    ddp, config, chunks = _hooked(VPP + ["parallel.distributed_optimizer=true", "parallel.overlap_param_gather=true",
                                        "parallel.overlap_grad_reduce=true"])
    assert ddp.align_param_gather is True
    assert config.param_sync_func == [c.start_param_sync for c in chunks]
    assert config.grad_sync_func == [c.start_grad_sync for c in chunks]
    assert config.no_sync_func == [c.no_sync for c in chunks]


@pytest.mark.parametrize("overrides", [
    ["parallel.pipeline=2", "parallel.distributed_optimizer=true", "parallel.overlap_param_gather=true"],  # no VPP
    VPP + ["parallel.distributed_optimizer=true", "parallel.overlap_param_gather=false"],
    VPP + ["parallel.distributed_optimizer=false", "parallel.overlap_param_gather=true"],
])
def test_no_param_sync_func_without_aligned_overlapped_gather(overrides):
    ddp, config, _ = _hooked(overrides)
    assert ddp.align_param_gather is ("parallel.virtual_pipeline=2" in overrides)
    assert config.param_sync_func is None


def test_one_chunk_gets_functions_not_lists():
    _, config, chunks = _hooked(["parallel.overlap_grad_reduce=true"])
    assert config.no_sync_func == chunks[0].no_sync and config.grad_sync_func == chunks[0].start_grad_sync


def test_cpu_rank_overlaps_nothing():
    job = compose_job(["recipe=smoke", *VPP, "parallel.distributed_optimizer=true"])
    ddp = optim.ddp_config(parallel=job.parallel, precision=job.precision, on_gpu=False)
    config = types.SimpleNamespace(param_sync_func=None, no_sync_func=None, grad_sync_func=None)
    optim.hook_model_config([_Chunk(ddp, config), _Chunk(ddp, config)], types.SimpleNamespace(scale_loss=None),
                            parallel=job.parallel)
    assert (config.param_sync_func, config.no_sync_func, config.grad_sync_func) == (None, None, None)
