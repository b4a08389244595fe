"""One training step, evaluation and the step loop (pipeline schedules from megatron.core)."""
from __future__ import annotations

import contextlib
import math
import signal
import statistics
import time
from functools import partial
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from launcher.core.signal_lead import TIME_LIMIT_REASON
from launcher.rank import signals
from launcher.rank.batch import batch_on_this_tp_rank, masked_token_loss, slice_batch_for_context_parallel
from launcher.schema import Schedule
from models.backend import compute_device

# Stop requests: the Slurm job script turns --signal=B:USR1 into a STOP file in the bundle (torchrun would
# die on USR1); SIGUSR1, SIGTERM, SIGINT and SIGHUP sent to a rank work too (launcher/rank/signals.py: a rank
# that cannot reach a step boundary still exits soon after SIGTERM, as torchrun's teardown expects).


def forward_step(data_iterator, model, return_schedule_plan: bool = False, *, batch_shape=None):
    """Megatron forward_step_func, with Megatron-LM ``pretrain_gpt.py`` ``forward_step``'s protocol: the
    micro-batch read on TP rank 0 and broadcast to the TP group (``batch_on_this_tp_rank``, pretrain_gpt.py
    ``get_batch`` -> ``get_batch_on_this_tp_rank``; ``batch_shape`` = (micro_batch_size, seq_length), what the
    other TP ranks receive into: ``forward_step_for`` binds it), this CP rank's slice of it through GPTModel
    (``slice_batch_for_context_parallel``, ``get_batch`` -> ``get_batch_on_this_cp_rank``), per-token losses
    reduced by ``masked_token_loss`` (a mean over the whole sequence's tokens, across the CP group). Both paths
    give the model the same inputs as pretrain_gpt.py: ``(tokens, position_ids, attention_mask=None, labels=,
    loss_mask=)`` (loss_mask masks the MTP loss like the LM loss; what a stage does not need is None).

    ``return_schedule_plan=True`` is how Megatron-Core's combined 1F1B schedule (parallel.moe_a2a_overlap,
    ``overlap_moe_expert_parallel_comm``) calls it: ``combined_1f1b.combined_forward_backward_step`` passes the
    GPTModel it unwrapped itself and expects ``(model.build_schedule_plan(...), loss_func)`` back, the plan an
    ``AbstractSchedulePlan`` (pretrain_gpt.py ``forward_step``: ``if return_schedule_plan: assert
    args.overlap_moe_expert_parallel_comm ... schedule_plan = model.build_schedule_plan(tokens, position_ids,
    attention_mask, labels=labels, loss_mask=loss_mask)``)."""
    # a middle pipeline stage reads no batch (pretrain_gpt.py get_batch: Nones); slicing passes Nones through
    batch = slice_batch_for_context_parallel(batch_on_this_tp_rank(data_iterator, model, batch_shape))
    loss_func = partial(masked_token_loss, batch["loss_mask"])
    inputs = (batch["tokens"], batch["position_ids"], None)
    if return_schedule_plan:
        from megatron.core.utils import get_attr_wrapped_model

        # the schedule already unwrapped DDP/Float16Module; unwrapping again is a no-op and keeps a wrapped
        # chunk (a caller other than combined_1f1b) working the same
        gpt = get_attr_wrapped_model(model, "build_schedule_plan", return_model_obj=True)
        if not gpt.config.overlap_moe_expert_parallel_comm:  # pretrain_gpt.py asserts the same
            raise RuntimeError("forward_step(return_schedule_plan=True) is the combined 1F1B schedule's call; "
                               "it needs parallel.moe_a2a_overlap=true (overlap_moe_expert_parallel_comm)")
        return gpt.build_schedule_plan(*inputs, labels=batch["labels"], loss_mask=batch["loss_mask"]), loss_func
    return model(*inputs, labels=batch["labels"], loss_mask=batch["loss_mask"]), loss_func


def forward_step_for(*, micro_batch_size: int, seq_length: int) -> Callable:
    """``forward_step`` with the micro-batch shape bound (the TP ranks other than 0 receive into it)."""
    return partial(forward_step, batch_shape=(micro_batch_size, seq_length))


def schedule_func(kind: str, zb_v_costs=None) -> Callable:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if kind in Schedule.ZERO_BUBBLE:  # no upstream zero-bubble schedule: ours, on Megatron's p2p and step functions
        from launcher.rank import zb_executor as zero_bubble

        if kind == Schedule.ZB_V and zb_v_costs:  # schedule.zb_v_costs: the order generated for those chunk costs
            return partial(zero_bubble.forward_backward_zb_v, costs=tuple(zb_v_costs))
        return getattr(zero_bubble, f"forward_backward_{kind}")
    if kind not in (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED):
        raise NotImplementedError(f"schedule.kind={kind!r} is not available on the rank side; "
                                  "use 1f1b, interleaved, zb_h1 or zb_v")
    return get_forward_backward_func()  # picks interleaved when virtual_pipeline > 1


def _mean_lm_loss(losses: List[Dict[str, torch.Tensor]]) -> float:
    return float(torch.stack([x["lm loss"].float() for x in losses]).mean()) if losses else 0.0


def auxiliary_losses(config, num_microbatches: int, step: int) -> Dict[str, float]:
    """This step's MoE load-balancing / z-losses and MTP losses, as Megatron-LM's ``training_log``
    (megatron/training/training.py) computes them: Megatron-Core's own trackers, reduced across the ranks by
    them (the MoE tracker all-reduces its per-layer values over the pipeline group and averages over the
    TP x DP x CP group; the MTP helper all-reduces over the groups the MTP block registered), scaled by
    ``1 / num_microbatches`` and then cleared. Every rank must call it every step (the reductions are
    collectives; ``force_initialize`` gives ranks without MoE layers zero tensors on the compute device).
    Returns {} for a dense model without MTP."""
    out: Dict[str, float] = {}
    if getattr(config, "num_moe_experts", None):
        from megatron.core.transformer.moe.moe_utils import get_moe_metrics_tracker

        balancing = config.moe_router_load_balancing_type
        balancing = " ".join(balancing) if isinstance(balancing, (list, tuple)) else str(balancing)
        names = [name for kind, name in (("aux_loss", "load_balancing_loss"),
                                         ("seq_aux_loss", "seq_load_balancing_loss"),
                                         ("global_aux_loss", "global_load_balancing_loss")) if kind in balancing]
        if config.moe_z_loss_coeff is not None:  # training.py: `if args.moe_z_loss_coeff is not None`
            names.append("z_loss")
        totals: Dict[str, torch.Tensor] = {}
        get_moe_metrics_tracker().report(
            loss_scale=1 / num_microbatches, iteration=step, writer=None, wandb_writer=None,
            per_layer_logging=False, force_initialize=True, track_names=names, num_layers=config.num_layers,
            moe_layer_freq=config.moe_layer_freq, mtp_num_layers=config.mtp_num_layers, total_loss_dict=totals)
        out.update({name: float(value) for name, value in totals.items()})
    if getattr(config, "mtp_num_layers", None):
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        totals = {}
        MTPLossLoggingHelper.track_mtp_metrics(1 / num_microbatches, step, None, None, totals)
        out.update({name: float(value) for name, value in totals.items()})
    return out


# Why a run stops, as every rank reports it: the step's reduction carries one count per reason (a rank that saw
# none of its own learns the cause from the others: scancel signals each process, and a rank whose SIGTERM lands
# after the step's all-reduce would otherwise print "another rank asked to stop"). Earlier entries win when ranks
# saw different ones; a reason not listed is sent as the last.
STOP_FILE, EXIT_AFTER = "STOP file", "train.exit_after_minutes reached"
STOP_REASONS = (*(signals.reason(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)),
                EXIT_AFTER, STOP_FILE, f"{TIME_LIMIT_REASON} near", "another rank asked to stop")


def stop_code(why: Optional[str]) -> Optional[int]:
    """``why``'s index in STOP_REASONS (None: no reason)."""
    if why is None:
        return None
    if why in STOP_REASONS:
        return STOP_REASONS.index(why)
    return STOP_REASONS.index(f"{TIME_LIMIT_REASON} near") if why.startswith(TIME_LIMIT_REASON) else len(STOP_REASONS) - 1


def reduce_report(local_loss: float, why: Optional[str], kind: str = Schedule.ONE_F_ONE_B) -> tuple:
    """World all-reduce: mean loss over the ranks that hold it (the last stage's rank, TP rank 0: pipeline rank
    p - 1, or 0 under zb_v's V), and the stop reason the ranks agree on (an index in STOP_REASONS, None: go on)
    from this rank's ``why``. One small collective per step."""
    from megatron.core import parallel_state

    from launcher.core.pipeline.schedules import loss_rank

    holder = (parallel_state.get_pipeline_model_parallel_rank()
              == loss_rank(kind, parallel_state.get_pipeline_model_parallel_world_size())
              and parallel_state.get_tensor_model_parallel_rank() == 0)
    dev = compute_device()
    t = torch.zeros(2 + len(STOP_REASONS), dtype=torch.float64, device=dev)
    t[0], t[1] = (local_loss, 1.0) if holder else (0.0, 0.0)
    code = stop_code(why)
    if code is not None:
        t[2 + code] = 1.0
    torch.distributed.all_reduce(t)
    seen = [i for i, n in enumerate(t[2:].tolist()) if n > 0]
    return float(t[0] / t[1].clamp(min=1)), (seen[0] if seen else None)


def any_rank(flag: bool) -> bool:
    """World all-reduce of one flag: True when it is set on any rank."""
    t = torch.tensor([float(flag)], dtype=torch.float64,
                     device=compute_device())
    torch.distributed.all_reduce(t)
    return bool(t[0] > 0)


def local_grads_nonfinite(model) -> bool:
    """Any NaN/Inf in this rank's gradient buffers (Megatron DDP's contiguous grad_data), after the reduce."""
    for chunk in model:
        # Megatron DDP's `buffers` list shadows nn.Module.buffers(); anything else has no grad buffers
        buffers = [b for name in ("buffers", "expert_parallel_buffers")
                   for b in (getattr(chunk, name, None) if isinstance(getattr(chunk, name, None), list) else [])]
        for buf in buffers:
            if not bool(torch.isfinite(buf.grad_data).all()):
                return True
        if not buffers:
            for param in chunk.parameters():
                grad = getattr(param, "main_grad", None)
                grad = param.grad if grad is None else grad
                if grad is not None and not bool(torch.isfinite(grad).all()):
                    return True
    return False


def straggler_report(times_ms: List[float], margin: float) -> str:
    """One line: every rank's step time and, when one is more than ``margin`` slower than the median, its name."""
    median = statistics.median(times_ms)
    slowest = max(range(len(times_ms)), key=lambda r: times_ms[r])
    text = "step ms per rank: " + " ".join(f"{r}:{t:.0f}" for r, t in enumerate(times_ms))
    if median > 0 and times_ms[slowest] > median * (1 + margin):
        text += (f" | straggler: rank {slowest} at {times_ms[slowest]:.0f} ms is "
                 f"{times_ms[slowest] / median - 1:.0%} slower than the median {median:.0f} ms")
    return text


def should_disable_forward_pre_hook(model) -> bool:
    """Megatron-LM training.py ``should_disable_forward_pre_hook``: the parameter all-gather runs in forward
    pre-hooks, i.e. the distributed optimizer with ``overlap_param_gather``, and not Megatron-FSDP (which gathers
    its own way); Megatron-LM's ``has_optimizer`` is always true here. Read from the DDP config the chunks were
    wrapped with (the job's flags as they took effect: ``launcher.rank.optim.ddp_config``)."""
    ddp = getattr(model[0], "ddp_config", None)
    return bool(ddp is not None and not getattr(ddp, "use_megatron_fsdp", False)
                and ddp.use_distributed_optimizer and ddp.overlap_param_gather)


class FirstStepWithoutParamGather:
    """Megatron-LM ``train()``: "Disable forward pre-hook to start training to ensure that errors in checkpoint
    loading or random initialization don't propagate to all ranks in first all-gather (which is a no-op if things
    work correctly)": before the first step of a run (fresh or resumed) the forward pre-hooks are removed without
    a parameter sync (``disable_forward_pre_hook(model, param_sync=False)``) and ``config.param_sync_func`` is set
    aside, so the schedule's sync calls are no-ops; after the first step that updated the weights (a skipped step
    does not count: Megatron moves ``start_iteration`` on) the hooks come back (``enable_forward_pre_hook``) and so
    does ``param_sync_func``. Only under ``should_disable_forward_pre_hook``; elsewhere every call is a no-op.

    Not in Megatron-LM, whose ``train()`` ends the process: ``restore()`` puts back hooks and ``param_sync_func``
    left off by a run that ended before such a step, so the model leaves ``Loop.run`` as it came in."""

    def __init__(self, model) -> None:
        self.model, self.off, self._param_sync_func = model, False, None

    def start(self) -> None:
        if not should_disable_forward_pre_hook(self.model):
            return
        from megatron.core.utils import get_model_config

        for chunk in self.model:
            chunk.disable_forward_pre_hook(param_sync=False)
        config = get_model_config(self.model[0])
        self._param_sync_func, config.param_sync_func = config.param_sync_func, None
        self.off = True

    def after_step(self, skipped: bool) -> None:
        if self.off and not skipped:
            self.restore()

    def restore(self) -> None:
        if not self.off:
            return
        from megatron.core.utils import get_model_config

        for chunk in self.model:
            chunk.enable_forward_pre_hook()
        get_model_config(self.model[0]).param_sync_func = self._param_sync_func
        self.off, self._param_sync_func = False, None


class TECudaGraphs:
    """train.cuda_graph_impl=transformer_engine, as Megatron-LM's ``train()`` drives it (training.py): a
    ``TECudaGraphHelper`` built before the first step; at the step ``cuda_graph_warmup_steps`` after this run's
    start, ``create_cudagraphs()`` (TE's make_graphed_callables over every microbatch's layers), with the forward
    pre-hooks off around it and the graphs' manual parameter-gather hooks set after it when the pre-hooks are in use
    (``should_disable_forward_pre_hook``); with no warm-up those hooks are set once the first step re-enabled the
    pre-hooks; ``delete_cuda_graphs()`` at the end. A no-op for any other cuda_graph_impl (``local`` graphs are
    built by Megatron-Core's own schedules, ``create_cudagraphs`` at the end of each forward-backward)."""

    def __init__(self, *, model, optimizer, train, seq_length: int, num_microbatches: int, dp_size: int) -> None:
        self.model, self.helper, self.warmup = model, None, train.cuda_graph_warmup_steps
        self.own_calculator = False
        if train.cuda_graph_impl != "transformer_engine":
            return
        from megatron.core import num_microbatches_calculator as nmc
        from megatron.core.transformer.cuda_graphs import TECudaGraphHelper
        from megatron.core.utils import get_model_config

        # the helper reads the capture order's microbatch count from Megatron's global calculator (with PP);
        # Megatron-LM initialises it in initialize_megatron, the launcher's schedules take the count as an argument
        if nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            nmc.init_num_microbatches_calculator(rank, None, num_microbatches * train.micro_batch_size * dp_size,
                                                 train.micro_batch_size, dp_size)
            self.own_calculator = True
        self.helper = TECudaGraphHelper(model=model, config=get_model_config(model[0]), seq_length=seq_length,
                                        micro_batch_size=train.micro_batch_size, optimizers=[optimizer])

    def before_step(self, done_this_run: int) -> None:
        if self.helper is None or self.helper.capture_finished() or done_this_run != self.warmup:
            return
        hooks = self.warmup > 0 and should_disable_forward_pre_hook(self.model)
        if hooks:
            for chunk in self.model:
                chunk.disable_forward_pre_hook(param_sync=False)
        self.helper.create_cudagraphs()
        if hooks:
            for chunk in self.model:
                chunk.enable_forward_pre_hook()
            self.helper.cuda_graph_set_manual_hooks()

    def pre_hooks_restored(self) -> None:
        """The first step's parameter-gather pre-hooks came back (FirstStepWithoutParamGather.after_step)."""
        if self.helper is not None and self.warmup == 0 and self.helper.capture_finished():
            self.helper.cuda_graph_set_manual_hooks()

    def close(self) -> None:
        if self.helper is not None and self.helper.graphs_created():
            self.helper.delete_cuda_graphs()
        if self.own_calculator:
            from megatron.core import num_microbatches_calculator as nmc

            nmc.destroy_num_microbatches_calculator()
            self.own_calculator = False


def _ignore(*_args) -> None:
    return None


@dataclass
class Hooks:
    """What ``Loop.run`` calls out to, and what stops it besides the step count: ``on_step(record)`` after every
    step, ``on_eval(step, loss)``, ``on_checkpoint()`` every checkpoint.save_interval steps, ``on_note(line)`` for a
    warning or a straggler report; ``stop_check()`` a reason to stop (e.g. close to the time limit) or None,
    ``deadline`` (train.exit_after_minutes, time.time() seconds) and ``stop_file`` (DIR/STOP) stop it too;
    ``profiler`` (launcher.rank.profiling.StepProfiler) is told before and after each step."""

    on_step: Callable[[dict], None] = _ignore
    on_eval: Callable[[int, float], None] = _ignore
    on_checkpoint: Callable[[], None] = _ignore
    on_note: Optional[Callable[[str], None]] = None
    stop_check: Optional[Callable[[], Optional[str]]] = None
    profiler: Any = None
    deadline: Optional[float] = None
    stop_file: Optional[Path] = None

    def local_reason(self, requested: Optional[str]) -> Optional[str]:
        """This rank's reason to stop after this step (``requested``: a signal's), None to go on."""
        return (requested
                or (EXIT_AFTER if self.deadline is not None and time.time() > self.deadline
                    else STOP_FILE if self.stop_file is not None and self.stop_file.exists()
                    else self.stop_check() if self.stop_check is not None else None))

    def note(self, line: str) -> None:
        if self.on_note:
            self.on_note(line)


class _AroundSteps:
    """What one ``Loop.run`` wraps its steps in: the first step without the parameter all-gather
    (FirstStepWithoutParamGather) and TE's CUDA graphs (TECudaGraphs), both undone when the run ends."""

    def __init__(self, lp: "Loop") -> None:
        self.first_step = FirstStepWithoutParamGather(lp.model)
        self.graphs = TECudaGraphs(model=lp.model, optimizer=lp.optimizer, train=lp.train, seq_length=lp.seq_length,
                                   num_microbatches=lp.num_microbatches, dp_size=lp.dp_size)
        self.first_step.start()
        self.start_step = lp.step

    def before(self, step: int) -> None:
        self.graphs.before_step(step - self.start_step)

    def after(self, skipped: bool) -> None:
        hooks_were_off = self.first_step.off
        self.first_step.after_step(skipped)  # Megatron-LM: right after train_step
        if hooks_were_off and not self.first_step.off:
            self.graphs.pre_hooks_restored()

    def close(self) -> None:
        self.first_step.restore()
        self.graphs.close()


class Loop:
    """Step loop state: what a checkpoint restores (step, consumed samples) and the stop flag; what it runs to
    (``steps``), how often it checkpoints (``save_interval``) and what a step's throughput is counted from
    (``flops_per_token``, ``tokens_per_step``, ``world``): ``from_job`` reads them off the job and the layout."""

    def __init__(self, *, model, optimizer, scheduler, train, seq_length: int, num_microbatches: int,
                 kind: str, dp_size: int, record_timeline: bool = False, zb_v_costs=None, steps: int = 0,
                 save_interval: int = 0, flops_per_token: float = 0.0, tokens_per_step: int = 0, world: int = 1):
        self.model, self.optimizer, self.scheduler, self.train = model, optimizer, scheduler, train
        self.seq_length, self.num_microbatches, self.dp_size = seq_length, num_microbatches, dp_size
        self.steps, self.save_interval = steps, save_interval
        self.flops_per_token, self.tokens_per_step, self.world = flops_per_token, tokens_per_step, world
        self.kind, self.fwd_bwd = kind, schedule_func(kind, zb_v_costs)
        self.forward_step = forward_step_for(micro_batch_size=train.micro_batch_size, seq_length=seq_length)
        self.recorder = None  # schedule.record_timeline: spans of the last training step (zero_bubble.Recorder)
        if record_timeline:
            from launcher.rank.zb_executor import Recorder

            self.recorder = Recorder()
        self.step, self.consumed = 0, 0
        self.spikes = None  # train.spike_factor: the entry's launcher.rank.spikes.SpikeGuard
        self.signals = signals.STATE
        self.signals.install()
        self.stop_reason: Optional[str] = None
        """Why run() returned 'stopped' or 'nonfinite' (for the final line)."""

    @classmethod
    def from_job(cls, job, layout, model, optimizer, scheduler) -> "Loop":
        """The loop of ``job`` on this ``layout`` (launcher.core.derive) over the built objects."""
        from launcher.core.flops import flops_per_token

        return cls(model=model, optimizer=optimizer, scheduler=scheduler, train=job.train,
                   seq_length=job.model.seq_length, num_microbatches=layout.microbatches, kind=job.schedule.kind,
                   dp_size=layout.dp, record_timeline=job.schedule.record_timeline,
                   zb_v_costs=job.schedule.zb_v_costs, steps=layout.steps,
                   save_interval=job.checkpoint.save_interval, flops_per_token=flops_per_token(job.model),
                   tokens_per_step=layout.tokens_per_step, world=layout.world)

    def _iter_arg(self, iterators):
        return iterators if len(self.model) > 1 else iterators[0]

    def train_step(self, iterators) -> dict:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self.optimizer.param_groups[0]["lr"]
        with self._recording() as (fwd_bwd, step_func):
            losses = fwd_bwd(forward_step_func=step_func, data_iterator=self._iter_arg(iterators),
                             model=self.model, num_microbatches=self.num_microbatches,
                             seq_length=self.seq_length, micro_batch_size=self.train.micro_batch_size,
                             forward_only=False)
        local_loss = _mean_lm_loss(losses)
        from megatron.core.utils import get_model_config

        aux = auxiliary_losses(get_model_config(self.model[0]), self.num_microbatches, self.step + 1)
        bad = None
        # Without a grad norm (clip_grad=0) a NaN gradient would only show in the next step's loss, after a
        # checkpoint may have saved the NaN weights; skipping needs the verdict before the update.
        if self.train.nonfinite == "skip" or not self.train.clip_grad:
            bad = any_rank(not math.isfinite(local_loss) or local_grads_nonfinite(self.model))
        # the loss-spike rule judges before the update, like the non-finite one (launcher/rank/spikes.py)
        spike = self.spikes.verdict(self.step + 1, self.consumed, local_loss) if self.spikes and not bad else None
        self.step += 1
        self.consumed += self.train.global_batch_size
        if bad and self.train.nonfinite == "skip":  # no update: weights, Adam state and LR schedule unchanged
            return {"local_loss": local_loss, "lr": lr, "grad_norm": float("nan"), "nonfinite": True,
                    "skipped": True, "aux": aux}
        if spike is not None:  # 'skip' or 'rollback': no update either, the batch consumed
            return {"local_loss": local_loss, "lr": lr, "grad_norm": 0.0, "skipped": True, "spike": spike,
                    "aux": aux}
        scale = self.spikes.lr_scale(self.step) if self.spikes else 1.0
        if scale != 1.0:  # after a skipped spike: this update at a lower rate (the scheduler resets it next step)
            for group in self.optimizer.param_groups:
                group["lr"] *= scale
            lr *= scale
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        return {"local_loss": local_loss, "lr": lr, "nonfinite": bool(bad), "aux": aux,
                "grad_norm": float(grad_norm) if grad_norm is not None else 0.0}

    @contextlib.contextmanager
    def _recording(self):
        """(schedule function, forward step) for this step, timed when the timeline is recorded."""
        if self.recorder is None:
            yield self.fwd_bwd, self.forward_step
            return
        from launcher.rank import zb_executor as zb

        self.recorder.start_step()
        if self.kind in Schedule.ZERO_BUBBLE:
            yield partial(self.fwd_bwd, recorder=self.recorder), self.forward_step
        elif self.kind == Schedule.ONE_F_ONE_B:
            with zb.recording_megatron_1f1b(self.recorder):
                yield self.fwd_bwd, zb.recorded_forward(self.forward_step, self.recorder)
        else:  # interleaved: not recorded
            yield self.fwd_bwd, self.forward_step

    @torch.no_grad()
    def evaluate(self, iterators) -> float:
        for chunk in self.model:
            chunk.eval()
        losses = []
        for _ in range(max(1, self.train.eval_iters)):
            out = self.fwd_bwd(forward_step_func=self.forward_step, data_iterator=self._iter_arg(iterators),
                               model=self.model, num_microbatches=self.num_microbatches,
                               seq_length=self.seq_length, micro_batch_size=self.train.micro_batch_size,
                               forward_only=True)
            losses.append(_mean_lm_loss(out))
        for chunk in self.model:
            chunk.train()
        loss, _ = reduce_report(sum(losses) / len(losses), None, self.kind)
        return loss

    def run(self, iterators, valid_iters: Callable, hooks: Optional[Hooks] = None) -> str:
        """Train to ``self.steps``; returns why it stopped: 'done', 'stopped' (STOP file, SIGUSR1 or time
        limit; the caller then checkpoints), 'nonfinite' (NaN/Inf loss or grad norm with
        train.nonfinite=stop; the caller must not checkpoint) or 'spike' (a first loss spike, not applied: the
        caller rolls back to the last checkpoint and calls run again). Any rank's reason stops all ranks at the same
        step; ``stop_reason`` says which."""
        hooks = hooks if hooks is not None else Hooks()
        around = _AroundSteps(self)
        try:
            while self.step < self.steps:
                out, loss, why, agreed, elapsed = self._timed_step(iterators, hooks, around)
                verdict = self._after_step(out, loss, (why, agreed), elapsed, valid_iters, hooks)
                if verdict is not None:
                    return verdict
            return "done"
        finally:
            around.close()

    def _timed_step(self, iterators, hooks: Hooks, around: _AroundSteps) -> tuple:
        """One training step, agreed on and reported: (train_step's record, the ranks' mean loss, this rank's
        reason to stop, the agreed one, seconds)."""
        from launcher.rank.metrics import memory_gib

        if hooks.profiler is not None:  # profile.*: opens the trace / capture range at profile.step_start
            hooks.profiler.before(self.step + 1)
        around.before(self.step)
        start = time.perf_counter()
        out = self.train_step(iterators)
        around.after(bool(out.get("skipped")))
        why = hooks.local_reason(self.signals.requested)
        loss, agreed = reduce_report(out["local_loss"], why, self.kind)
        elapsed = time.perf_counter() - start
        self.signals.step_s = elapsed
        tflops = self.flops_per_token * self.tokens_per_step / elapsed / self.world / 1e12
        hooks.on_step({"step": self.step, "loss": loss, "lr": out["lr"], "grad_norm": out["grad_norm"],
                       "ms_per_step": elapsed * 1e3, "tokens_per_s": self.tokens_per_step / elapsed,
                       "tflops": tflops,
                       "mem_gib": memory_gib(), **out.get("aux", {})})  # MoE/MTP losses: appended last
        if hooks.profiler is not None:
            hooks.profiler.after(self.step)
        return out, loss, why, agreed, elapsed

    def _after_step(self, out: dict, loss: float, reasons: tuple, elapsed: float, valid_iters: Callable,
                    hooks: Hooks) -> Optional[str]:
        """What follows a step, in this order: a spike's rollback, evaluation, the non-finite rule, the straggler
        report, an agreed stop, the periodic checkpoint. Returns run()'s verdict, or None to go on."""
        why, agreed = reasons
        if out.get("spike") == "rollback":  # the caller rolls back to the last checkpoint and replays
            self.stop_reason = f"loss spike at step {self.step}"
            return "spike"
        if self.train.eval_interval and self.step % self.train.eval_interval == 0:
            vi = valid_iters()
            if vi is not None:
                hooks.on_eval(self.step, self.evaluate(vi))
        if out.get("nonfinite") or not (math.isfinite(loss) and math.isfinite(out["grad_norm"])):
            what = f"loss {loss}, grad norm {out['grad_norm']}"
            if not out.get("skipped"):
                self.stop_reason = f"non-finite {what} at step {self.step}"
                return "nonfinite"
            hooks.note(f"warning: non-finite {what} at step {self.step}: update skipped (train.nonfinite=skip)")
        if self.train.straggler_interval and self.step % self.train.straggler_interval == 0:
            times = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(times, elapsed * 1e3)
            hooks.note(straggler_report(times, self.train.straggler_margin))
        if agreed is not None:
            # every rank names the same cause, the one the ranks agreed on (its own words when it saw that
            # one itself: the time-limit guard's figures), whichever rank noticed it first
            self.signals.at_boundary()
            self.stop_reason = why if stop_code(why) == agreed else STOP_REASONS[agreed]
            return "stopped"
        if self.save_interval and self.step % self.save_interval == 0:
            hooks.on_checkpoint()
        return None
