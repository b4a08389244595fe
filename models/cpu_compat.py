"""Bridge Megatron-Core's CUDA assumptions so it trains on CPU-only torch (gloo).

Megatron-Core has no CPU path: on a CPU build of torch every ``torch.cuda.current_device()``,
``torch.cuda.synchronize()``, stream call and ``device='cuda'`` factory raises "Torch not compiled with
CUDA enabled". Rather than patching torch globally, :func:`apply` gives the few Megatron modules that make
such calls their own ``torch`` name: a proxy that forwards everything to real torch except

* ``torch.cuda.current_device()``   -> ``"cpu"`` (used as ``device=`` for factories and ``.to()``),
* ``torch.cuda.synchronize`` / streams / events -> no-ops (CPU ops are synchronous),
* ``torch.cuda.get_rng_state`` / ``manual_seed`` -> the CPU generator (the RNG tracker keeps per-rank
  named CPU states, so dropout in TP regions still differs per TP rank),
* factories (``zeros``, ``empty``, ``tensor``, ...) with ``device='cuda'`` -> CPU,
* ``torch.distributed.all_to_all_single`` with split sizes given as tensors/arrays -> lists (gloo needs
  Python ints; NCCL accepts what MoE's dispatcher passes).

Three method-level assumptions cannot be reached through a module's ``torch`` name and are wrapped at the
one function that makes them: ``Tensor.type() == 'torch.cuda.FloatTensor'`` checks (clip_grads, the
distributed / float16 optimizers) and ``Tensor.cuda()`` when first/last pipeline stages share embeddings.

Megatron-FSDP (``parallel.megatron_fsdp``) runs on CPU through the same proxy, which :func:`apply_fsdp` gives
its modules (FSDP_MODULES) with two more mappings: ``torch.device('cuda:...')`` -> cpu (mcore_fsdp_adapter.py:156,
megatron_fsdp.py:232 build the device from ``current_device()``) and ``DeviceMesh.from_group(device_type='cuda')``
-> a CPU mesh (mcore_fsdp_adapter.py:407-449); ``Tensor.cuda()`` in ``validate_uneven_dtensor``
(uneven_dtensor.py:187) is ``.to('cpu')``. Its coalesced collectives run to completion inside their
``_coalescing_manager`` block (:func:`_completed_coalescing`): Megatron-FSDP's parameter prefetch keeps several
asynchronous coalesced all-gathers of one group in flight (param_and_grad_buffer.py:4561, ``async_ops=True``), and
on gloo they run at once on the group's two worker threads, which corrupted the heap of a TP2 x DP2 job in about one
run in ten here (gdb of the core: the abort in one worker's ``AsyncAllgatherCoalescedWork`` while the other ran a
second one; gloo's asynchronous allgather_coalesced crashes are pytorch/pytorch#65237). On a GPU each runs as an
NCCL kernel ordered on Megatron-FSDP's all-gather stream; on CPU there is no overlap to lose. Its gradient reduce divides inside NCCL's PREMUL_SUM unless
``gradient_reduce_div_fusion`` is off (param_and_grad_buffer.py:4746); gloo has no PREMUL_SUM, so the rank wing
turns that fusion off on CPU (launcher/rank/optim.py).

Applied only when ``torch.cuda.is_available()`` is False; idempotent. Nothing happens at import time.
(Not CUDA-related and therefore elsewhere: the distributed optimizer's Adam-step restore bug is handled in
launcher/rank/checkpoint/store.py; the interleaved PP=2 batch_p2p guard in models/builder.py.)
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any, Callable

import torch

_APPLIED = False

# Megatron modules that call torch.cuda.* or use device='cuda' factories on the training path (0.19.2).
PATCHED_MODULES = (
    "megatron.core.utils",  # GlobalMemoryBuffer / l2 norm helpers: current_device, device='cuda'
    "megatron.core.pipeline_parallel.p2p_communication",  # current_device, synchronize
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens = zeros(device='cuda')
    "megatron.core.distributed.param_and_grad_buffer",  # current_device, current_stream
    "megatron.core.distributed.distributed_data_parallel",  # Stream for overlapped grad reduce
    "megatron.core.optimizer.optimizer",  # found_inf / scale tensors on 'cuda'
    "megatron.core.optimizer.distrib_optimizer",  # gather buffers on current_device
    "megatron.core.optimizer.clip_grads",  # norm / overflow buffers on 'cuda'
    "megatron.core.optimizer.cpu_offloading.hybrid_optimizer",  # optimizer CPU offload: d2h/h2d streams
    "megatron.core.tensor_parallel.layers",  # SP all-gather buffers on current_device
    "megatron.core.tensor_parallel.mappings",  # all_to_all buffers; split sizes for gloo
    "megatron.core.tensor_parallel.random",  # RNG tracker uses torch.cuda RNG state
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # inv_freq .to(current_device)
    "megatron.core.dist_checkpointing.strategies.filesystem_async",  # synchronize before writing
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",  # failure flag on current_device
    "megatron.core.dist_checkpointing.strategies.async_utils",  # synchronize
    "megatron.core.dist_checkpointing.exchange_utils",  # shard exchange buffers on current_device
    "megatron.core.transformer.utils",  # default causal mask built on device="cuda"
    "megatron.core.transformer.moe.router",  # aux-loss tensors on current_device
    "megatron.core.transformer.moe.moe_utils",  # tokens-per-expert buffers
    "megatron.core.transformer.moe.token_dispatcher",  # over_budget flag on 'cuda', d2h stream
    "megatron.core.transformer.moe.moe_layer",  # streams
    "megatron.core.transformer.multi_token_prediction",  # MTP loss-logging buffers on current_device
)

FSDP_MODULES = (
    "megatron.core.distributed.fsdp.mcore_fsdp_adapter",  # device from current_device; DeviceMesh on 'cuda'
    "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",  # device check; side streams
    "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer",  # streams, synchronize, buffers
    "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision",  # overflow buffer on 'cuda'
    "megatron.core.distributed.fsdp.src.megatron_fsdp.utils",  # RNG helpers, current_device
    "megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor",  # boundary checks .cuda()
    "megatron.core.transformer.fsdp_dtensor_checkpoint",  # DeviceMesh on 'cuda' when validating a load
)
"""Megatron-FSDP's modules (0.19.2): they get TORCH_ON_CPU_FSDP, and DeviceMesh where they import it by name."""

_FACTORIES = frozenset({"zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like",
                        "empty_like", "full_like", "randn", "rand", "randint"})


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec ('cuda', 'cuda:0', torch.device('cuda'), an int index) to 'cpu'."""
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


def _factory(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)
    return wrapper


class _NullStream:
    """Stands in for torch.cuda.Stream/Event: CPU work is synchronous, so waits and records are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):  # wait_stream, record_event, synchronize, ...: no-ops returning a null
        return lambda *args, **kwargs: _NullStream()

    def __eq__(self, other):
        return isinstance(other, _NullStream)

    __hash__ = object.__hash__


class _CudaOnCpu:
    """torch.cuda as seen by a patched Megatron module."""

    Stream = Event = _NullStream

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def synchronize(*args, **kwargs):
        return None

    @staticmethod
    def current_stream(*args, **kwargs):
        return _NullStream()

    @staticmethod
    def stream(*args, **kwargs):
        return contextlib.nullcontext()

    @staticmethod
    def get_rng_state(*args, **kwargs):
        return torch.get_rng_state()

    @staticmethod
    def manual_seed(seed):
        torch.random.default_generator.manual_seed(int(seed))


class _DistributedOnCpu:
    """torch.distributed with all_to_all_single split sizes converted to Python lists (gloo needs them)."""

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    @staticmethod
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        return torch.distributed.all_to_all_single(
            output, input, output_split_sizes=_as_list(output_split_sizes),
            input_split_sizes=_as_list(input_split_sizes), **kwargs)


def _as_list(sizes):
    if sizes is None or isinstance(sizes, list):
        return sizes
    return [int(s) for s in (sizes.tolist() if hasattr(sizes, "tolist") else sizes)]


class _TorchOnCpu:
    """The ``torch`` name inside a patched module: real torch except cuda, distributed, factories."""

    cuda = _CudaOnCpu()
    distributed = _DistributedOnCpu()

    def __getattr__(self, name):
        attr = getattr(torch, name)
        return _factory(attr) if name in _FACTORIES else attr


TORCH_ON_CPU = _TorchOnCpu()


class _DeviceOnCpu:
    """``torch.device`` inside Megatron-FSDP's modules: a CUDA device is the CPU (an instance check still works)."""

    def __call__(self, *args, **kwargs):
        if args and isinstance(args[0], str) and args[0].startswith("cuda"):
            return torch.device("cpu")
        return torch.device(*args, **kwargs)

    def __instancecheck__(self, obj):
        return isinstance(obj, torch.device)


class _TorchOnCpuFsdp(_TorchOnCpu):
    device = _DeviceOnCpu()


TORCH_ON_CPU_FSDP = _TorchOnCpuFsdp()


class _DeviceMeshOnCpu:
    """``DeviceMesh`` as Megatron-FSDP's modules see it: meshes over gloo groups are CPU meshes."""

    def __getattr__(self, name):
        from torch.distributed import DeviceMesh

        return getattr(DeviceMesh, name)

    @staticmethod
    def from_group(*args, **kwargs):
        from torch.distributed import DeviceMesh

        kwargs["device_type"] = "cpu"
        return DeviceMesh.from_group(*args, **kwargs)

    def __instancecheck__(self, obj):
        from torch.distributed import DeviceMesh

        return isinstance(obj, DeviceMesh)


@contextlib.contextmanager
def _cuda_type_names():
    """Make ``Tensor.type()`` answer 'torch.cuda.FloatTensor' (etc.) for CPU tensors, for checks that
    only mean "a float32/bf16/fp16 device tensor"."""
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        if args or kwargs:
            return original(self, *args, **kwargs)
        name = original(self)
        return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    """``Tensor.cuda()`` returns the tensor itself (it already lives on the only device)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


@contextlib.contextmanager
def _tensor_cuda_is_to_cpu():
    """``Tensor.cuda()`` is ``Tensor.to('cpu')``: the tensor itself on CPU, and for the NCCL emulation
    (tests/_nccl_emulation.py) a tensor moved to the compute device, as ``.cuda()`` makes it on a GPU."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self.to("cpu")
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _wrap(owner: Any, name: str, context: Callable) -> None:
    """Run ``owner.name`` inside ``context()``, keeping staticmethod/classmethod kinds."""
    raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    fn = raw.__func__ if kind else raw

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with context():
            return fn(*args, **kwargs)

    setattr(owner, name, kind(wrapper) if kind else wrapper)


def _cpu_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def apply() -> bool:
    """Install the bridges (only without CUDA; once). Returns True when this call applied them."""
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return False
    for name in PATCHED_MODULES:
        importlib.import_module(name).torch = TORCH_ON_CPU

    random = importlib.import_module("megatron.core.tensor_parallel.random")
    # The RNG tracker's fork() saves/restores "the device generator": on CPU that is the CPU generator.
    random._get_cuda_rng_state = _cpu_rng_state
    random._set_cuda_rng_state = _set_cpu_rng_state

    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    _wrap(clip_grads, "clip_grad_by_total_norm_fp32", _cuda_type_names)
    optimizer = importlib.import_module("megatron.core.optimizer")
    # The optimizer module imported the function by name before we wrapped it.
    if getattr(optimizer.optimizer, "clip_grad_by_total_norm_fp32", None) is not None:
        optimizer.optimizer.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    _wrap(distrib.DistributedOptimizer, "_build_model_and_main_param_groups", _cuda_type_names)
    _wrap(optimizer.optimizer.Float16OptimizerWithFloat16Params, "__init__", _cuda_type_names)

    language_module = importlib.import_module("megatron.core.models.common.language_module.language_module")
    _wrap(language_module.LanguageModule, "setup_embeddings_and_output_layer", _tensor_cuda_is_identity)
    hybrid = importlib.import_module("megatron.core.optimizer.cpu_offloading.hybrid_optimizer")
    hybrid.HybridDeviceOptimizer._get_sub_optimizer_param_groups = _hybrid_param_groups_on_cpu
    _wrap(hybrid.HybridDeviceOptimizer, "_move_new_state_to_right_device", _cuda_string_is_cpu)
    _APPLIED = True
    return True


def _hybrid_param_groups_on_cpu(self, offload_fraction: float):
    """``HybridDeviceOptimizer._get_sub_optimizer_param_groups`` (hybrid_optimizer.py, 0.19.2) with the compute
    device being the CPU. Upstream sorts parameters by ``Tensor.is_cuda``: device parameters are offloaded, first
    come, until ``offload_fraction`` of their elements has a host copy (``detach().clone().cpu().pin_memory()``,
    stepped by the CPU optimizer and copied back after its step); the rest stay with the device optimizer; with
    ``param_update_in_fp32`` each non-fp32 parameter gets an fp32 copy. On CPU every parameter the model holds is
    a device parameter (is_cuda is False for all of them, which sent all to the host groups without a copy and
    failed in the first step: KeyError in ``_set_sub_optimizer_grads``); host copies are plain clones (no pinned
    allocator without an accelerator). Same outputs, same order, same split as on a GPU."""
    params = [p for group in self.param_groups for p in group["params"]]
    offload_threshold = sum(p.numel() for p in params) * offload_fraction
    offloaded = 0
    cpu_param_groups, gpu_param_groups = [], []
    gpu_params_map_cpu_copy, cpu_copys_map_gpu_param, param_to_fp32_param = {}, {}, {}
    for group in self.param_groups:
        gpu_group, cpu_group = dict(group, params=[]), dict(group, params=[])
        for orig in group["params"]:
            param, host = orig, False
            if offloaded < offload_threshold:
                param, host = orig.detach().clone(), True
                offloaded += param.numel()
            if self.param_update_in_fp32 and param.dtype != torch.float32:
                param = param.detach().clone().float()
                param_to_fp32_param[orig] = param
            if host:
                gpu_params_map_cpu_copy[orig] = param
                cpu_copys_map_gpu_param[param] = orig
            (cpu_group if host else gpu_group)["params"].append(param)
        if gpu_group["params"]:
            gpu_param_groups.append(gpu_group)
        if cpu_group["params"]:
            cpu_param_groups.append(cpu_group)
    return cpu_param_groups, gpu_param_groups, gpu_params_map_cpu_copy, cpu_copys_map_gpu_param, param_to_fp32_param


@contextlib.contextmanager
def _cuda_string_is_cpu():
    """``Tensor.to("cuda")`` is ``Tensor.to("cpu")`` (HybridDeviceOptimizer moves the device optimizer's new state
    with it)."""
    original = torch.Tensor.to

    def to(self, *args, **kwargs):
        args = tuple("cpu" if isinstance(a, str) and a.startswith("cuda") else a for a in args)
        if isinstance(kwargs.get("device"), str) and kwargs["device"].startswith("cuda"):
            kwargs["device"] = "cpu"
        return original(self, *args, **kwargs)

    torch.Tensor.to = to
    try:
        yield
    finally:
        torch.Tensor.to = original


_FSDP_APPLIED = False


def _completed_coalescing(manager: Callable) -> Callable:
    """``torch.distributed._coalescing_manager`` whose collectives have completed when its block exits, whatever
    ``async_ops`` asks: the manager it yields holds no work, so a later ``.wait()`` returns at once. At most one
    coalesced gloo collective of a group is then in flight, issued and waited by the training thread."""

    @contextlib.contextmanager
    def completed(group=None, device=None, async_ops: bool = False):
        with manager(group, device, async_ops=False) as cm:
            yield cm

    completed.__wrapped__ = manager
    return completed


def apply_fsdp() -> bool:
    """The Megatron-FSDP bridges (only without CUDA; once; imports Megatron-FSDP, so only for a job that uses
    it: launcher/rank/optim.py calls it before wrapping). Returns True when this call applied them."""
    global _FSDP_APPLIED
    if _FSDP_APPLIED or torch.cuda.is_available():
        return False
    apply()
    modules = [importlib.import_module(name) for name in FSDP_MODULES]
    for module in modules:
        module.torch = TORCH_ON_CPU_FSDP
        if "DeviceMesh" in vars(module):
            module.DeviceMesh = _DeviceMeshOnCpu()
    uneven = importlib.import_module("megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor")
    _wrap(uneven, "validate_uneven_dtensor", _tensor_cuda_is_to_cpu)
    buffer = importlib.import_module("megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer")
    buffer.validate_uneven_dtensor = uneven.validate_uneven_dtensor  # imported by name before the wrap
    buffer._coalescing_manager = _completed_coalescing(buffer._coalescing_manager)  # imported by name too
    _FSDP_APPLIED = True
    return True


def is_applied() -> bool:
    """Whether the bridges are installed in this process."""
    return _APPLIED
