"""models/cpu_compat.py: a no-op with CUDA; on CPU torch, each bridge behaves as the real thing would."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from _rank_harness import ROOT, single_process_group


def test_noop_when_cuda_is_available():
    code = """
import sys, torch
torch.cuda.is_available = lambda: True          # pretend: a GPU machine
from models import cpu_compat
assert cpu_compat.apply() is False and not cpu_compat.is_applied()
assert not any(m.startswith('megatron') for m in sys.modules), 'must not even import megatron'
assert torch.Tensor.type.__qualname__ == 'TensorBase.type' or torch.Tensor.type.__name__ == 'type'
"""
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


@pytest.fixture(scope="module")
def compat():
    from models import cpu_compat

    cpu_compat.apply()
    return cpu_compat


def test_apply_is_idempotent_and_patches_only_listed_modules(compat):
    import importlib

    assert compat.is_applied() and compat.apply() is False
    for name in compat.PATCHED_MODULES:
        assert importlib.import_module(name).torch is compat.TORCH_ON_CPU, name
    # global torch is untouched: code outside megatron still sees the real CPU-only torch
    assert importlib.import_module("megatron.core.transformer.module").torch is torch
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()


def test_device_factories_and_cuda_calls(compat):
    t = compat.TORCH_ON_CPU
    assert t.zeros(2, device="cuda").device.type == "cpu"
    assert t.tensor([1.0], device=torch.device("cuda")).device.type == "cpu"
    assert t.empty(3, device=t.cuda.current_device()).device.type == "cpu"
    assert t.ones(1, device="cpu").device.type == "cpu"
    assert t.cuda.current_device() == "cpu"
    assert t.cuda.synchronize() is None
    stream = t.cuda.Stream()
    stream.wait_stream(t.cuda.current_stream())
    stream.record_event().synchronize()
    with t.cuda.stream(stream):
        pass
    assert t.cuda.current_stream() == stream  # "not on a side stream" checks stay False
    assert t.nn is torch.nn and t.float32 is torch.float32


def test_cuda_type_names_only_inside_the_wrapped_call(compat):
    x = torch.zeros(2)
    with compat._cuda_type_names():
        assert x.type() == "torch.cuda.FloatTensor"
        assert x.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert x.type(torch.float64).dtype == torch.float64  # conversion form untouched
    assert x.type() == "torch.FloatTensor"


def test_clip_grads_run_on_cpu(compat):
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(2)]
    for p in params:
        p.grad = torch.full((4,), 2.0)
    clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=8.0)  # asserted cuda FloatTensor before
    assert torch.allclose(params[0].grad, torch.full((4,), 2.0 / 8.0), rtol=1e-5)


def test_rng_tracker_keeps_named_cpu_streams(compat):
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    torch.manual_seed(7)
    default_before = torch.get_rng_state()
    tracker.add("model-parallel-rng", 1234)
    with tracker.fork("model-parallel-rng"):
        first = torch.rand(3)
    with tracker.fork("model-parallel-rng"):
        second = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), default_before)  # the default stream is restored
    torch.manual_seed(1234)
    assert torch.equal(torch.cat([first, second]), torch.rand(6))  # the named stream continues


def test_all_to_all_split_sizes_become_lists(compat):
    single_process_group()
    x, out = torch.arange(4.0), torch.empty(4)
    with pytest.raises(TypeError):  # why the bridge exists: gloo's binding rejects tensor split sizes
        torch.distributed.all_to_all_single(out, x, output_split_sizes=torch.tensor([4]),
                                            input_split_sizes=torch.tensor([4]))
    compat.TORCH_ON_CPU.distributed.all_to_all_single(out, x, output_split_sizes=torch.tensor([4]),
                                                      input_split_sizes=np.array([4]))
    assert torch.equal(out, x)


def test_tensor_cuda_is_identity_only_in_context(compat):
    x = torch.ones(2)
    with compat._tensor_cuda_is_identity():
        assert x.cuda() is x
    with pytest.raises((AssertionError, RuntimeError)):
        x.cuda()


def test_megatron_fsdp_coalesced_collectives_complete_inside_their_block(compat):
    """Megatron-FSDP's prefetch opens ``_coalescing_manager(group, async_ops=True)`` and waits later; on gloo that
    leaves several coalesced all-gathers running at once on the group's worker threads (the heap corruption of
    tests/test_fsdp.py's stress run). Under apply_fsdp the block's collectives have completed when it exits and the
    manager holds no work; the real manager, asked the same, holds one still to be waited."""
    import importlib

    import torch.distributed as dist

    single_process_group()
    compat.apply_fsdp()
    buffer = importlib.import_module("megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer")
    out, shard = torch.zeros(4), torch.arange(4.0)
    with buffer._coalescing_manager(dist.group.WORLD, async_ops=True) as cm:
        dist.all_gather_into_tensor(out, shard, async_op=True)
    assert cm.works == [] and torch.equal(out, shard)
    cm.wait()  # what Megatron-FSDP's wait_bucket_ready calls: a no-op now
    real = buffer._coalescing_manager.__wrapped__
    assert real is dist.distributed_c10d._coalescing_manager
    with real(dist.group.WORLD, async_ops=True) as cm:
        dist.all_gather_into_tensor(out, shard, async_op=True)
    assert len(cm.works) == 1
    cm.wait()
