"""Split backward for zero-bubble pipeline schedules: B (input gradient) now, W (weight gradient) later.

Megatron-Core 0.19.2 has no such split for dense layers: its local ``ColumnParallelLinear`` /
``RowParallelLinear.backward_dw`` are no-ops, and its own ``delay_wgrad_compute`` belongs to the MoE
all-to-all overlap path (``TransformerConfig`` refuses it without ``overlap_moe_expert_parallel_comm``).
So the split is ours, behind this module:

* CPU / local spec: the parallel linear layers' backward computes the input gradient (and its TP all-reduce or
  SP reduce-scatter) and the bias gradient as usual, and, while :data:`STORE` is capturing, queues the
  weight-gradient GEMM ``grad_output^T @ input`` instead of running it. The queued step does 1F1B's arithmetic
  (Megatron's ``LinearWithGradAccumulationAndAsyncCommunication.backward``, same per-microbatch order): with
  gradient-accumulation fusion (the GPU's output layer) Megatron's kernel accumulates the GEMM into the fp32
  ``weight.main_grad``; without it the GEMM in the weight's dtype becomes ``param.grad``, which Megatron DDP's
  hook adds to ``main_grad``. So gradient accumulation and the DP reduce see what 1F1B gives them. Outside
  capture (1F1B, evaluation, anything else) the layers behave exactly as Megatron's.
* GPU / Transformer Engine: TE's linear modules take ``delay_wgrad_compute=True`` and compute W in
  ``backward_dw()``. Megatron's TE wrappers read that flag from their config, so our spec classes hand them a
  config copy with the flag set (the job's TransformerConfig stays valid for Megatron's checks); a W slot
  calls ``backward_dw()`` on every such module, each popping its oldest queued microbatch (FIFO).

The schedule (``launcher/rank/zb_executor.py``) calls :meth:`WeightGradStore.flush` after each B and
:meth:`WeightGradStore.pop` in each W slot.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import functools
from typing import Callable, Deque, List, Optional, Tuple

import torch

from launcher.schema import Schedule

ZB_ATTR = "zb_delayed_wgrad"
"""Attribute set on modules whose weight gradient is deferred (local: queued in STORE; TE: backward_dw)."""
ZB_HOOKS = "_zb_grad_hooks"
"""Attribute of a deferred weight: Megatron DDP's grad hooks for it, run by its W step (local path)."""


class WeightGradStore:
    """Pending weight-gradient work of this process, one entry per microbatch, first in first out.

    Always on and O(1) per tensor: ``held_bytes`` is what the queued work keeps alive now (the GEMM inputs and
    output gradients of the local path, the sum of their ``untyped_storage()`` sizes, a storage shared by several
    tensors counted once), ``peak_bytes`` / ``peak_microbatches`` the most since the last :meth:`clear` (the
    executor clears at the start of each step, so after a step they are that step's). TE's ``backward_dw``
    work keeps its tensors inside TE and is not counted."""

    def __init__(self) -> None:
        self.capturing = False
        self._current: List[Callable[[], None]] = []
        self._current_keys: List[int] = []
        self._queue: Deque[Tuple[int, List[Callable[[], None]]]] = collections.deque()
        self._queue_keys: Deque[List[int]] = collections.deque()
        self._storages: dict = {}  # storage data_ptr -> [nbytes, references from queued work]
        self.held_bytes = self.peak_bytes = self.peak_microbatches = 0

    @contextlib.contextmanager
    def capture(self):
        """While active, deferrable linear layers queue their W instead of running it."""
        previous, self.capturing = self.capturing, True
        try:
            yield self
        finally:
            self.capturing = previous

    def put(self, work: Callable[[], None], tensors=()) -> None:
        """Queue one W step of the current B; ``tensors``: what it keeps alive until it runs (counted)."""
        self._current.append(work)
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            entry = self._storages.get(key)
            if entry is None:  # alive while referenced here, so its address cannot be reused meanwhile
                entry = self._storages[key] = [storage.nbytes(), 0]
                self.held_bytes += entry[0]
            entry[1] += 1
            self._current_keys.append(key)
        self._note_peak()

    def _note_peak(self) -> None:
        if self.held_bytes > self.peak_bytes:
            self.peak_bytes = self.held_bytes
        self.peak_microbatches = max(self.peak_microbatches, self.pending())

    def _release(self, keys: List[int]) -> None:
        for key in keys:
            entry = self._storages[key]
            entry[1] -= 1
            if not entry[1]:
                self.held_bytes -= entry[0]
                del self._storages[key]

    def flush(self, microbatch: int, te_modules=()) -> None:
        """Close the W work of one B (one microbatch); TE modules' backward_dw joins it."""
        work = self._current + [module.backward_dw for module in te_modules]
        self._queue.append((microbatch, work))
        self._queue_keys.append(self._current_keys)
        self._current, self._current_keys = [], []
        self._note_peak()

    def pop(self, microbatch: Optional[int] = None) -> int:
        """Run the oldest microbatch's W; returns its microbatch index."""
        if not self._queue:
            raise RuntimeError("W slot with no pending weight-gradient work (schedule order is wrong)")
        mb, work = self._queue.popleft()
        keys = self._queue_keys.popleft()
        if microbatch is not None and mb != microbatch:
            raise RuntimeError(f"W slot for microbatch {microbatch} but the oldest pending W is {mb}")
        run_microbatch(work)
        self._release(keys)
        return mb

    def pending(self) -> int:
        return len(self._queue) + (1 if self._current else 0)

    def clear(self) -> None:
        """Drop all pending work and reset the byte counters (the executor calls this at each step's start)."""
        self._current, self._queue = [], collections.deque()
        self._current_keys, self._queue_keys, self._storages = [], collections.deque(), {}
        self.held_bytes = self.peak_bytes = self.peak_microbatches = 0


STORE = WeightGradStore()
"""The process's store (one schedule runs at a time per process)."""


def _linear_autograd():
    """The autograd Function: Megatron's forward, a backward that defers W while STORE captures."""
    from megatron.core.tensor_parallel import layers
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication as Base
    from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

    class DeferredWgradLinear(Base):
        @staticmethod
        @layers.custom_bwd
        def backward(ctx, grad_output):
            input_, weight = ctx.saved_tensors
            if ctx.gtp_remat_size > 1 or ctx.grad_output_buffer is not None or (
                    not STORE.capturing and not getattr(weight, ZB_HOOKS, None)):
                return Base.backward(ctx, grad_output)
            group = ctx.tp_group
            if ctx.sequence_parallel:  # a fresh buffer: the shared "mpu" buffer is reused before W runs
                size = list(input_.size())
                size[0] *= group.size()
                total_input = torch.empty(size, dtype=input_.dtype, device=input_.device)
                layers.dist_all_gather_func(total_input, input_, group=group)
            else:
                total_input = input_
            grad_input = grad_output.matmul(weight)
            grad_output_2d, total_input_2d = prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
            if ctx.allreduce_dgrad:
                torch.distributed.all_reduce(grad_input, group=group)
            if ctx.sequence_parallel:
                sub = torch.empty(list(input_.size()), dtype=input_.dtype, device=input_.device)
                layers.dist_reduce_scatter_func(sub, grad_input, group=group)
                grad_input = sub
            grad_bias = grad_output_2d.sum(dim=0) if ctx.use_bias else None
            step = _Wgrad(weight, grad_output_2d, total_input_2d, ctx.main_grad)
            if STORE.capturing:
                STORE.put(step, (grad_output_2d, total_input_2d))
            else:  # a backward outside a ZB schedule: W at once, through DDP's hook like the deferred one
                step()
            return grad_input, None, grad_bias, None, None, None, None, None, None, None

    return DeferredWgradLinear


class _Wgrad:
    """The deferred W of one linear layer and microbatch, with 1F1B's arithmetic, which is Megatron's
    ``LinearWithGradAccumulationAndAsyncCommunication.backward`` (tensor_parallel/layers.py):

    * gradient-accumulation fusion (``fused_main_grad``: the layer's ``gradient_accumulation_fusion`` and the
      weight's ``main_grad``; on GPU, the output layer): Megatron's kernel accumulates the GEMM into ``main_grad``
      in main_grad's dtype (``wgrad_gemm_accum_fp32`` into an fp32 ``main_grad``), once per use of the weight
      (``accumulate``); the product is never rounded to the operands' dtype. Autograd is then handed a dummy
      gradient, which DDP's hook, seeing ``grad_added_to_main_grad``, does not add (``finish_fused``).
    * otherwise: the GEMM in the operands' dtype (``compute``: ``grad_output.t().matmul(total_input)``) becomes
      ``.grad``, which DDP's hook adds to ``main_grad`` (``finish``). A weight used several times in one
      microbatch (the output layer under MTP) gets one ``finish`` with the sum, as autograd sums a leaf's incoming
      gradients before its accumulator (and DDP's hook) runs once."""

    __slots__ = ("weight", "grad_output", "total_input", "fused_main_grad")

    def __init__(self, weight, grad_output, total_input, fused_main_grad) -> None:
        self.weight, self.grad_output, self.total_input = weight, grad_output, total_input
        self.fused_main_grad = fused_main_grad

    @property
    def fused(self) -> bool:
        return self.fused_main_grad is not None

    @torch.no_grad()  # outside autograd's backward: no graph for the GEMM or the accumulation
    def compute(self):
        return self.grad_output.t().matmul(self.total_input)

    @torch.no_grad()
    def accumulate(self) -> None:
        wgrad_gemm_accum(self.total_input, self.grad_output, self.fused_main_grad)

    @torch.no_grad()
    def finish_fused(self) -> None:
        """After the weight's last fused GEMM of the microbatch: the weight gradient Megatron's backward returns
        (where DDP marks its weights with ``grad_added_to_main_grad``, a dummy of the input's dtype, zeros under
        ``zero_out_wgrad``, for which DDP's hook does add it; else None), through DDP's hook."""
        weight = self.weight
        grad = None
        if hasattr(weight, "grad_added_to_main_grad"):
            make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
            grad = make(self.fused_main_grad.shape, dtype=self.total_input.dtype, device=self.total_input.device)
            weight.grad_added_to_main_grad = True
        hooks = getattr(weight, ZB_HOOKS, None)
        if hooks:
            weight.grad = grad
            for hook in hooks:
                hook()
        # no DDP hook (unit tests): the sum is in main_grad already; autograd would only have kept the dummy

    @torch.no_grad()
    def finish(self, grad_weight) -> None:
        weight = self.weight
        hooks = getattr(weight, ZB_HOOKS, None)
        if hooks:  # Megatron DDP's own grad hook, handed to the module (ddp_config.delay_wgrad_compute)
            weight.grad = grad_weight  # the hook adds it to main_grad and drops it, as in 1F1B,
            for hook in hooks:  # then, under overlap_grad_reduce, marks the weight ready for its bucket's reduce
                hook()
            return
        main_grad = getattr(weight, "main_grad", None)
        if main_grad is not None:  # Megatron DDP: the hook's ``param.main_grad.add_(param.grad)``
            main_grad.add_(grad_weight)
        elif weight.grad is None:  # no DDP wrapper (unit tests): autograd's accumulation
            weight.grad = grad_weight
        else:
            weight.grad.add_(grad_weight)

    def __call__(self) -> None:
        if self.fused:
            self.accumulate()
            self.finish_fused()
        else:
            self.finish(self.compute())


def wgrad_gemm_accum(total_input, grad_output, main_grad) -> None:
    """``main_grad += grad_output^T @ total_input`` by Megatron's gradient-accumulation-fusion kernel, chosen as
    its backward chooses it (fp32 ``main_grad``: ``wgrad_gemm_accum_fp32``; fp16/bf16: ``wgrad_gemm_accum_fp16``).
    Looked up on Megatron's module, so it is the very kernel its backward calls (Megatron refuses
    ``gradient_accumulation_fusion`` where the kernel is missing)."""
    from megatron.core.tensor_parallel import layers

    kernels = layers.fused_weight_gradient_mlp_cuda
    if main_grad.dtype == torch.float32:
        kernels.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        kernels.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    else:
        raise RuntimeError("Unsupported gradient type for gradient accumulation fusion")


def run_microbatch(work: list) -> None:
    """Run one microbatch's W work in B's order: TE ``backward_dw`` callables as they are; local fused GEMMs each
    into main_grad as they come, then one ``finish_fused`` per weight after its last use; local unfused GEMMs with
    one ``finish`` per weight, after its last use (autograd's ``old + new`` per extra use)."""
    last = {id(w.weight): i for i, w in enumerate(work) if isinstance(w, _Wgrad)}
    pending: dict = {}
    for i, step in enumerate(work):
        if not isinstance(step, _Wgrad):
            step()
            continue
        key = id(step.weight)
        if step.fused:
            step.accumulate()
            if last[key] == i:
                step.finish_fused()
            continue
        grad = step.compute()
        if key in pending:
            grad = pending.pop(key) + grad
        if last[key] == i:
            step.finish(grad)
        else:
            pending[key] = grad


_AUTOGRAD = None


def deferred_linear(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                    grad_output_buffer=None, wgrad_deferral_limit=0, tp_group=None, gtp_remat_size=1):
    """``linear_with_grad_accumulation_and_async_allreduce`` with a deferrable weight gradient."""
    global _AUTOGRAD
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    if _AUTOGRAD is None:
        _AUTOGRAD = _linear_autograd()
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    return _AUTOGRAD.apply(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                           sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group, gtp_remat_size)


def _deferred_forward_impl(self, input, weight, *args, **kwargs):
    if not weight.requires_grad:
        return self._zb_base._forward_impl(self, input, weight, *args, **kwargs)
    return deferred_linear(input, weight, *args, **kwargs)


def _register_wgrad_hooks(self, hook) -> None:
    """Megatron DDP with ``ddp_config.delay_wgrad_compute`` gives the grad hook of a weight marked
    ``skip_backward_post_hook`` to its module (distributed_data_parallel.py, the path TE's ``backward_dw`` uses)
    instead of autograd's accumulator: the hook then runs when W has computed the gradient, not in B (where it
    would see no gradient and, under ``overlap_grad_reduce``, assert)."""
    setattr(self.weight, ZB_HOOKS, getattr(self.weight, ZB_HOOKS, []) + [hook])


def mark_deferred_weights(chunk) -> int:
    """Mark the weights of a chunk's deferrable local linear layers for DDP (``skip_backward_post_hook``); returns
    how many. Call before wrapping the chunk in DDP with ``delay_wgrad_compute=True``."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    count = 0
    for module in chunk.modules():
        weight = getattr(module, "weight", None)
        if (getattr(type(module), ZB_ATTR, False) and isinstance(module, (ColumnParallelLinear, RowParallelLinear))
                and weight is not None and weight.requires_grad):
            weight.skip_backward_post_hook = True
            count += 1
    return count


@functools.lru_cache(maxsize=None)
def local_classes():
    """(ColumnParallelLinear, RowParallelLinear) subclasses whose W is deferrable."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    def subclass(base):
        return type(f"ZB{base.__name__}", (base,), {
            "_forward_impl": _deferred_forward_impl, ZB_ATTR: True, "_zb_base": base,
            "register_wgrad_accumulation_and_reduce_hooks": _register_wgrad_hooks,
            "__doc__": f"{base.__name__} whose weight-gradient GEMM is queued in STORE while it captures."})

    return subclass(ColumnParallelLinear), subclass(RowParallelLinear)


def defer_module(module) -> None:
    """Make one already-built Column/RowParallelLinear deferrable (GPTModel builds its output layer itself,
    outside the layer spec)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    column, row = local_classes()
    if type(module) is ColumnParallelLinear:
        module.__class__ = column
    elif type(module) is RowParallelLinear:
        module.__class__ = row


ZB_TP_OVERLAP = {"tp_comm_bulk_wgrad": False, "tp_comm_bulk_dgrad": False, "tp_comm_overlap_rs_dgrad": True}
"""TransformerConfig fields under a zero-bubble schedule with ``parallel.tp_comm_overlap`` (Transformer Engine 2.7,
the NGC 25.09 image's, to 2.20.0.dev0 at d0067d0 read alike). TE forbids only the bulk wgrad overlap with
delayed wgrad: ``WeightGradStore.__init__`` asserts "ub_bulk_wgrad is not supported when enabling
delay_wgrad_compute" (module/_common.py) and the backward raises "Delayed weight grad computation is not supported
with Userbuffers" when the wgrad GEMM carries a userbuffer (linear.py, layernorm_linear.py, layernorm_mlp.py),
which only ``ub_bulk_wgrad`` gives it. The bulk dgrad overlap is not refused by TE but all-gathers the layer
input, the deferred wgrad GEMM's operand, into the shared ``qkv_dgrad``/``fc1_dgrad`` userbuffer
(``fill_userbuffers_buffer_for_all_gather``: "the underlying data may be overwritten by other Userbuffers
operations"), which the next layer's backward overwrites before W runs; without it TE gathers the input with
an async NCCL all-gather under the dgrad GEMM. With the bulk wgrad overlap gone, the column-parallel input
gradient's reduce-scatter runs as TE's pipelined dgrad overlap (``ub_overlap_rs_dgrad``; userbuffers
``models.backend.ZB_UB_CFGS``). The forward overlaps (``tp_comm_overlap_ag``/``_rs`` on column/row layers) hold nothing W needs."""
ZB_ROW_TP_OVERLAP = {"tp_comm_overlap_ag": False}
"""The row-parallel layers' (proj, fc2) own config under zero bubble: Megatron maps ``tp_comm_overlap_ag`` to TE's
``ub_overlap_ag``, on a row-parallel Linear the output-gradient all-gather pipelined with the dgrad GEMM
(``ub_overlap_ag_dgrad``), which leaves the gathered gradient, the deferred wgrad GEMM's other operand, in the
shared ``proj_dgrad``/``fc2_dgrad`` userbuffer (TE: "Userbuffers leaves the gathered tensor in its persistent
buffer"): overwritten by the next layer's backward before W. Column-parallel layers keep it (forward all-gather)."""


def zb_tp_overlap(kind: str, tp_comm_overlap: bool) -> dict:
    """TransformerConfig fields a zero-bubble schedule sets with userbuffer TP overlap (none otherwise)."""
    return dict(ZB_TP_OVERLAP) if tp_comm_overlap and kind in Schedule.ZERO_BUBBLE else {}


def te_delayed_class(base):
    """A Megatron TE linear wrapper built with TE's ``delay_wgrad_compute=True``: its config is a copy with
    ``delay_wgrad_compute`` set, which Megatron's wrappers pass to TE and honour in ``backward_dw`` (and, on a
    row-parallel layer with TP overlap, ``ZB_ROW_TP_OVERLAP``)."""
    row = base.__name__ == "TERowParallelLinear"  # expert linears get no userbuffers (Megatron: is_expert)

    def __init__(self, *args, config, **kwargs):
        own = copy.copy(config)
        own.delay_wgrad_compute = True
        if row and getattr(config, "tp_comm_overlap", False):
            for name, value in ZB_ROW_TP_OVERLAP.items():
                setattr(own, name, value)
        base.__init__(self, *args, config=own, **kwargs)

    return type(f"ZB{base.__name__}", (base,), {"__init__": __init__, ZB_ATTR: True,
                                                  "__doc__": f"{base.__name__} with delay_wgrad_compute=True."})


def spec_mapping(te: bool) -> dict:
    """Class replacements for the decoder layer spec under a zero-bubble schedule."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if not te:
        column, row = local_classes()
        return {ColumnParallelLinear: column, RowParallelLinear: row}
    from megatron.core.extensions import transformer_engine as mte

    names = ("TELayerNormColumnParallelLinear", "TEColumnParallelLinear", "TERowParallelLinear", "TELinear",
             "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear")  # MoE experts: TE GroupedLinear
    # without TE, Megatron's wrappers derive from a MagicMock and are no classes: nothing to map
    return {getattr(mte, n): _te_class(getattr(mte, n)) for n in names if isinstance(getattr(mte, n, None), type)}


@functools.lru_cache(maxsize=None)
def _te_class(base):
    return te_delayed_class(base)


def te_modules(chunk) -> list:
    """The TE modules of a chunk whose W runs in ``backward_dw`` (in reverse build order, as backward runs)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return [m for m in reversed(list(chunk.modules()))
            if getattr(type(m), ZB_ATTR, False) and not isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def defer_wgrad_spec(spec, te: bool):
    """The decoder block spec with deferrable-W linear layers (local) or TE's delayed wgrad (GPU)."""
    from models.backend import replace_in_spec

    return replace_in_spec(spec, spec_mapping(te))


def defer_output_layer(chunk) -> None:
    """GPTModel's output layer (a Megatron ColumnParallelLinear on every backend) defers its W too."""
    layer = getattr(chunk, "output_layer", None)
    if layer is not None:
        defer_module(layer)


# ------------------------------------------------------------------------------------------------ ZB-V
def v_layer_rank(kind: str, p: int, rank: int, chunk: int) -> int:
    """The pipeline rank whose interleaved chunk ``chunk`` holds the same stage as this rank's chunk under
    ``kind``: itself, except ZB-V's chunk 1 (stage 2p - 1 - r = interleaved chunk 1 of rank p - 1 - r)."""
    return p - 1 - rank if kind == Schedule.ZB_V and chunk == 1 else rank


def holds_stage(kind: str, p: int, rank: int, chunk: int, chunks: int, first: bool) -> bool:
    """Whether this rank's ``chunk`` is the first (embedding) or the last (output layer, loss) pipeline stage
    (``launcher.core.pipeline.schedules.stage_of``; ZB-V: both on rank 0)."""
    from launcher.core.pipeline.schedules import stage_of

    stage = stage_of(kind if kind == Schedule.ZB_V else Schedule.INTERLEAVED, p, rank, chunk)
    return stage == 0 if first else stage == p * chunks - 1


class MirroredPipelineGroup:
    """The pipeline process group as ZB-V's chunk 1 must see it to be built as the stage it holds: ``rank()``
    answers the rank whose interleaved chunk 1 that stage is (``v_layer_rank``); everything else is the real
    group's. Megatron-Core reads the pipeline rank from the model's process-group collection to number the
    layers (transformer_block.py, transformer_layer.py ``get_transformer_layer_offset``), so checkpoints keep
    global layer numbers."""

    def __init__(self, group, rank: int) -> None:
        self._group, self._rank = group, rank

    def rank(self) -> int:
        return self._rank

    def __getattr__(self, name):
        return getattr(self._group, name)


def v_chunk_pg_collection(layer_rank: int):
    """Megatron's default process-group collection with the pipeline group mirrored (``MirroredPipelineGroup``)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = copy.copy(ProcessGroupCollection.use_mpu_process_groups())
    pgs.pp = MirroredPipelineGroup(pgs.pp, layer_rank)
    return pgs
