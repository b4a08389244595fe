"""Login-node planner: FLOPs, memory per pipeline stage, step time, MFU, and a layout search.

``plan_job(job)`` answers "does this layout fit, and how fast will it be?" in well under a second, without
torch or megatron. ``search(job)`` (in ``launcher.plan.search``) ranks alternative layouts. Constants and
where they come from: ``launcher/plan/NOTES.md``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from launcher.core import Layout, padded_vocab
from launcher.core.flops import flops_per_step, flops_per_token
from launcher.plan.memory import GB, StageMemory, host_fits, memory_per_stage, model_params
from launcher.plan.timing import StepTime, step_time, throughput, zb_v_costs_best
from launcher.problems import Problem
from launcher.schema import JobConfig, Recompute, Schedule
from launcher.validate import Checked, check

__all__ = ["Plan", "PlanError", "plan_job", "oom_message", "flops_per_token", "flops_per_step"]

LAYOUT_FIELDS = ("parallel.", "model.", "schedule.", "train.micro_batch_size", "train.global_batch_size", "nodes",
                 "cluster.gpus_per_node", "train.recompute")
"""Validation problems under these fields make a plan meaningless (the layout itself is invalid)."""


def layout_errors(problems: list[Problem]) -> list[Problem]:
    """The errors among ``problems`` that make the layout itself invalid (so it cannot be planned)."""
    return [p for p in problems if p.severity == "error" and p.field.startswith(LAYOUT_FIELDS)]


HINTS = {
    "activations": [("train.recompute=full", lambda j: j.train.recompute == Recompute.FULL),
                    ("train.recompute=selective with train.recompute_modules such as [core_attn,moe_act] or "
                     "[mla_up_proj,mlp]",
                     lambda j: j.train.recompute == Recompute.FULL or bool(j.train.recompute_modules)),
                    ("more parallel.pipeline / parallel.context / parallel.tensor, or a smaller "
                     "train.micro_batch_size", None)],
    "grads": [("precision.grad_reduce_in_fp32=false (bf16 gradient buffers)",
               lambda j: not j.precision.grad_reduce_in_fp32),
              ("parallel.megatron_fsdp=true", lambda j: j.parallel.megatron_fsdp),
              ("more parallel.tensor/pipeline", None)],
    "fp8_weights": [("precision.fp8_param=true (FP8 primary weights: no separate FP8 copy)",
                     lambda j: j.precision.fp8_param)],
    "optimizer": [("parallel.distributed_optimizer=true", lambda j: j.parallel.distributed_optimizer),
                  ("parallel.megatron_fsdp=true", lambda j: j.parallel.megatron_fsdp),
                  ("more data-parallel ranks (nodes)", None)],
    "weights": [("more parallel.tensor or parallel.pipeline (or parallel.expert for MoE)", None)],
    "output_logits": [("model.cross_entropy_loss_fusion=true (bf16 softmax)", lambda j: j.model.cross_entropy_loss_fusion),
                      ("more parallel.tensor (shards the vocabulary)", None),
                      ("fewer layers on the last stage (parallel.account_for_loss_in_pipeline_split=true or "
                       "parallel.last_stage_layers)", lambda j: j.parallel.account_for_loss_in_pipeline_split)],
    # (a virtual pipeline stays: zero bubble over chunks goes back to interleaved, without them to 1F1B)
    "pending_wgrad": [("schedule.kind=1f1b (no deferred weight gradients)",
                       lambda j: j.schedule.kind not in Schedule.ZERO_BUBBLE or (j.parallel.virtual_pipeline or 1) > 1),
                      ("schedule.kind=interleaved (no deferred weight gradients)",
                       lambda j: j.schedule.kind not in Schedule.ZERO_BUBBLE or (j.parallel.virtual_pipeline or 1) == 1),
                      ("more parallel.tensor (shards the deferred GEMM operands and the logits gradient), or a "
                       "smaller train.micro_batch_size", None)],
    "workspace": [("train.recompute=selective instead of full", lambda j: j.train.recompute != Recompute.FULL),
                  ("a smaller train.micro_batch_size", None)],
    "comm_buffers": [("a smaller train.micro_batch_size", None)],
    "cuda_graphs": [("fewer train.cuda_graph_modules (e.g. [attn,moe_router] instead of the whole layer)",
                     lambda j: bool(j.train.cuda_graph_modules)),
                    ("train.cuda_graph_impl=none (the graphs' static buffers go; host launch time comes back)", None)],
    "reserve": [("cluster.memory_reserve_gb (only if you know the site's overhead is smaller)", None)],
}
"""What to change when a contributor dominates a stage that does not fit: each option with the test of a job that
has it already (such a job is not told to set it)."""


def hint_for(contributor: str, job=None) -> str:
    """The options for one contributor, without those the job already has ('' when none is left)."""
    options = [text for text, has in HINTS.get(contributor, []) if job is None or has is None or not has(job)]
    return ", or ".join(options)


class PlanError(ValueError):
    """The job's layout is invalid, so it cannot be planned; the message lists the validation errors."""


@dataclass
class Plan:
    """The planner's verdict on one job."""

    name: str
    """Run name."""
    layout: dict
    """TP/PP/VPP/CP/EP/DP, micro/global batch, microbatches, schedule, recompute, world size."""
    stages: list[StageMemory]
    """Predicted peak memory per pipeline stage (one rank of each)."""
    gpu_memory_gb: float
    """Usable memory per GPU (cluster.gpu_memory_gb)."""
    flops_per_token: float
    """Training FLOPs per token (Megatron's formula)."""
    flops_per_step: float
    """Training FLOPs per optimizer step."""
    params: dict
    """Model parameter counts (total, embedding, expert)."""
    step: StepTime
    """Predicted step time and breakdown."""
    perf: dict
    """tokens_per_s, tokens_per_s_per_gpu, tflops_per_gpu, mfu."""
    warnings: list[str] = field(default_factory=list)
    """Validation warnings worth showing next to the plan."""
    timeouts: dict = field(default_factory=dict)
    """The collective and heartbeat timeouts render will write (launcher/core/timeouts.py ``derive``)."""
    checkpoint: dict = field(default_factory=dict)
    """checkpoint.async_save only: the save time hidden and the host memory a save in flight holds
    (launcher/core/checkpoint/directory.py ``async_save_costs``); empty otherwise."""

    def _offload_text(self) -> str:
        """What activation offloading moves: its modules and the pinned host memory the busiest rank holds."""
        mods = self.layout.get("activation_offload_modules")
        if not mods:
            return ""
        host = max(s.host.get("activations", 0.0) for s in self.stages)
        return (f"activation offload {', '.join(mods)}: {host / GB:.1f} GB of pinned host memory per GPU, PCIe "
                f"time exposed {self.step.breakdown_s.get('offload', 0):.2f} s")

    @property
    def peak_stage(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def peak_gb(self) -> float:
        return self.peak_stage.total / GB

    @property
    def fits(self) -> bool:
        return all(s.total <= self.gpu_memory_gb * GB for s in self.stages)

    @property
    def largest_contributors(self) -> list[tuple[str, float]]:
        """(name, GB) of the peak stage's three largest parts."""
        return [(k, v / GB) for k, v in self.peak_stage.largest(3)]

    def to_dict(self) -> dict:
        """JSON-able summary (what ``--json`` prints)."""
        return {
            "name": self.name, "layout": self.layout, "fits": self.fits, "gpu_memory_gb": self.gpu_memory_gb,
            "peak_gb": self.peak_gb, "peak_stage": self.peak_stage.stage,
            "largest_contributors_gb": dict(self.largest_contributors),
            "stages": [s.to_dict() for s in self.stages],
            "flops_per_token": self.flops_per_token, "gflops_per_token": self.flops_per_token / 1e9,
            "flops_per_step": self.flops_per_step, "params": self.params,
            "step": self.step.to_dict(), **self.perf, "warnings": self.warnings, "timeouts": self.timeouts,
            **({"checkpoint": self.checkpoint} if self.checkpoint else {}),
        }

    def table(self):
        """A rich renderable: layout, memory per stage (GB by contributor), time breakdown, throughput."""
        from rich.console import Group
        from rich.markup import escape  # names, layouts and warnings are data: "[attn,moe_router]" is not a style
        from rich.table import Table

        lay = self.layout
        title = escape(f"{self.name}: TP{lay['tp']} PP{lay['pp']}" + (f" VPP{lay['vpp']}" if lay["vpp"] > 1 else "")
                 + f" CP{lay['cp']}" + (f" EP{lay['ep']}" if lay["ep"] > 1 else "") + f" DP{lay['dp']}"
                 + f" on {lay['world']} GPUs, {lay['schedule']}, mbs {lay['mbs']} x {lay['microbatches']} microbatches,"
                 + f" recompute {lay['recompute']}")
        extras = [f"recompute modules {', '.join(lay['recompute_modules'])}" if lay["recompute_modules"] else "",
                  "embedding counted as a layer" if lay["account_for_embedding"] else "",
                  "loss counted as a layer" if lay["account_for_loss"] else "",
                  f"layout {lay['pipeline_layout']}" if lay["pipeline_layout"] else "",
                  "Megatron-FSDP" if lay["megatron_fsdp"] else "",
                  "MoE all-to-all overlap" if lay["moe_a2a_overlap"] else "",
                  self._offload_text(),
                  lay.get("zb_v_costs_hint", "")]
        extras = [escape(e) for e in extras if e]
        parts = list(self.stages[0].parts)
        mem = Table(title=title, title_justify="left")
        mem.add_column("stage")
        mem.add_column("layers", justify="right")
        for p in parts:
            mem.add_column(p, justify="right")
        mem.add_column("total GB", justify="right")
        for s in _stages_to_show(self.stages):
            ok = s.total <= self.gpu_memory_gb * GB
            mem.add_row(str(s.stage), str(s.layers), *[f"{s.parts[p] / GB:.1f}" for p in parts],
                        f"[{'green' if ok else 'red'}]{s.total / GB:.1f} / {self.gpu_memory_gb:g}[/]")
        tim = Table(title="time per step (s, busiest stage)", title_justify="left")
        shown = {k: v for k, v in self.step.breakdown_s.items() if v > 0}
        for k in shown:
            tim.add_column(k, justify="right")
        tim.add_column("step", justify="right")
        tim.add_row(*[f"{v:.3f}" for v in shown.values()], f"{self.step.step_s:.3f}")
        verdict = "[green]fits[/]" if self.fits else "[red]does NOT fit[/]"
        summary = (f"{verdict}  peak {self.peak_gb:.1f} GB on stage {self.peak_stage.stage}   "
                   f"{self.flops_per_token / 1e9:.2f} GFLOP/token   {self.perf['tokens_per_s']:,.0f} tokens/s   "
                   f"{self.perf['tflops_per_gpu']:.0f} TFLOP/s/GPU   MFU {100 * self.perf['mfu']:.1f}%   "
                   f"bubble {100 * self.step.bubble_fraction:.1f}%")
        if extras:
            summary += "\n" + "; ".join(extras)
        t = self.timeouts
        if t:
            summary += (f"\ntimeouts: hang {t['hang_s']} s (5 steps {t['step_wait_s']} s, a save {t['save_wait_s']} s), "
                        f"collective {t['collective_s']} s (first step {t['first_step_s']} s), heartbeat "
                        f"{t['heartbeat_s']} s; timeouts.* overrides")
        c = self.checkpoint
        if c:
            summary += (f"\nasync save: {c['hidden_s']:.0f} s per save hidden; a save in flight holds "
                        f"{c['host_bytes_per_rank'] / GB:.1f} GB of host memory per rank "
                        f"({c['host_bytes_per_node'] / GB:.0f} GB per node)")
        return Group(mem, tim, summary, *[f"[yellow]{escape(w)}[/]" for w in self.warnings])

    def text(self, width: int = 160) -> str:
        """The table as plain text."""
        from rich.console import Console

        console = Console(width=width, record=True, file=_Null(), color_system=None)
        console.print(self.table())
        return console.export_text()


class _Null:
    def write(self, _s):
        return 0

    def flush(self):
        pass


def _stages_to_show(stages: list[StageMemory]) -> list[StageMemory]:
    """First, last, the peak, and any stage unlike its neighbours (uneven splits); all when few."""
    if len(stages) <= 4:
        return stages
    peak = max(stages, key=lambda s: s.total)
    keep = {0, len(stages) - 1, peak.stage, 1, len(stages) - 2}
    return [s for s in stages if s.stage in keep]


def _layout(job: JobConfig, lay: Layout) -> dict:
    """The plan's layout summary: the derived sizes, plus the batch and schedule settings they came from."""
    par = job.parallel
    return {"tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "cp": lay.cp, "ep": lay.ep, "dp": lay.dp, "world": lay.world,
            "mbs": job.train.micro_batch_size, "gbs": job.train.global_batch_size, "microbatches": lay.microbatches,
            "schedule": job.schedule.kind, "recompute": job.train.recompute, "sequence_parallel": lay.sequence_parallel,
            "first_stage_layers": par.first_stage_layers, "last_stage_layers": par.last_stage_layers,
            "account_for_embedding": par.account_for_embedding_in_pipeline_split,
            "account_for_loss": par.account_for_loss_in_pipeline_split,
            "pipeline_layout": par.pipeline_model_parallel_layout, "stage_layers": list(lay.stage_layers),
            "megatron_fsdp": par.megatron_fsdp, "moe_a2a_overlap": par.moe_a2a_overlap,
            "recompute_modules": list(job.train.recompute_modules),
            "activation_offload_modules": list(job.train.activation_offload_modules)}


def _zb_v_costs_hint(job: JobConfig, lay: Layout, st: StepTime) -> str:
    """What the job's ZB-V order is generated for and, where the planner's own choice of chunk costs
    (``zb_v_costs_best``) times shorter, that choice with the bubble its order gives."""
    own = list(job.schedule.zb_v_costs or (1.0, 1.0, 1.0))
    text = f"zb_v order for schedule.zb_v_costs=[{','.join(f'{c:g}' for c in own)}]"
    best, tuned = zb_v_costs_best(job, lay, own=st)
    if tuned.step_s >= st.step_s * (1 - 1e-4):
        return text + " (as short as the planner's estimates give)"
    return (text + f" (bubble {100 * st.bubble_fraction:.1f}%); for this job's stage costs set "
            f"schedule.zb_v_costs=[{','.join(f'{c:g}' for c in best)}] (bubble {100 * tuned.bubble_fraction:.1f}%, "
            f"step {tuned.step_s:.3f} s instead of {st.step_s:.3f} s)")


def plan_job(job: JobConfig, *, checked: Checked | None = None) -> Plan:
    """Memory per stage, FLOPs, step time, throughput and MFU for the job's layout.

    ``checked``: the job's validation as the caller did it (the CLI hands its own on); validated here when None.
    Raises PlanError when the layout itself is invalid (validation errors on parallel/model/schedule/batch
    fields); other validation problems do not stop planning."""
    checked = checked or check(job)
    problems = checked.problems
    blocking = layout_errors(problems)
    if blocking:
        raise PlanError("cannot plan an invalid layout:\n" + "\n".join(p.line() for p in blocking))
    warnings = [p.line() for p in problems if p.severity != "error" and p.field.startswith(LAYOUT_FIELDS)]
    lay = checked.layout
    st = step_time(job, lay)
    counts = model_params(job.model, 1, padded_vocab(job.model, 1)).as_dict()  # reported at TP 1: the whole model
    layout = _layout(job, lay)
    if job.schedule.kind == Schedule.ZB_V and lay.pp > 1:
        layout["zb_v_costs_hint"] = _zb_v_costs_hint(job, lay, st)
    stages = memory_per_stage(job, lay)
    saving = _async_save(job, counts)
    if not host_fits(job, stages, saving.get("host_bytes_per_node", 0.0)):
        busiest = max(stages, key=lambda s: s.host_bytes)
        parts = {k: v * job.cluster.gpus_per_node for k, v in busiest.host.items() if v}
        if saving:
            parts["async save"] = saving["host_bytes_per_node"]
        warnings.append(f"host memory per node: {', '.join(f'{k} {v / GB:.0f} GB' for k, v in parts.items())}, "
                        f"more than cluster.host_memory_gb={job.cluster.host_memory_gb:g}: offload less "
                        "(train.activation_offload_modules / _fraction, train.optimizer_offload_fraction)")
    return Plan(
        name=job.name, layout=layout, stages=stages,
        gpu_memory_gb=job.cluster.gpu_memory_gb, flops_per_token=flops_per_token(job.model),
        flops_per_step=flops_per_step(job.model, lay.tokens_per_step),
        params=counts, step=st, perf=throughput(job, st, lay), warnings=warnings, timeouts=_timeouts(job, counts, st),
        checkpoint=saving)


def _async_save(job: JobConfig, counts: dict) -> dict:
    """checkpoint.async_save's costs for the whole model's checkpoint, else {}."""
    if not job.checkpoint.async_save:
        return {}
    from launcher.core.checkpoint.directory import async_save_costs

    return async_save_costs(counts["total"], job.precision.dtype, nodes=job.nodes,
                            gpus_per_node=job.cluster.gpus_per_node, write_gbps=job.cluster.checkpoint_write_gbps)


def _timeouts(job: JobConfig, counts: dict, st: StepTime) -> dict:
    """What render derives (launcher/render.py ``timeouts_of``): from this step time and the save time the signal
    lead uses (measured in checkpoint.dir, else estimated from the parameters)."""
    from pathlib import Path

    from launcher.core import timeouts
    from launcher.core.checkpoint.directory import checkpoint_dir
    from launcher.core.signal_lead import step_and_save_s

    ckpt_dir = checkpoint_dir(job.checkpoint.dir, Path()) if job.checkpoint.dir else None
    step_s, save_s, _, _ = step_and_save_s(job, {"params": counts, "step": {"step_s": st.step_s}}, ckpt_dir)
    return timeouts.derive(job, step_s=step_s, save_s=save_s)


def oom_message(plan: Plan, job=None) -> str:
    """Why the plan does not fit: every stage over the limit with its numbers, the largest contributors,
    and what to change for each (with ``job``: only what it does not have already)."""
    cap = plan.gpu_memory_gb
    over = [s for s in plan.stages if s.total > cap * GB]
    if not over:
        return f"{plan.name}: fits (peak {plan.peak_gb:.1f} GB of {cap:g} GB on stage {plan.peak_stage.stage})"
    lines = [f"{plan.name}: predicted out of memory on {len(over)} of {len(plan.stages)} pipeline stage(s) "
             f"(GPU has {cap:g} GB usable):"]
    for s in over:
        parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in s.parts.items() if v >= 0.05 * GB)
        pending = f", {s.pending_w} with weight gradients pending" if "pending_wgrad" in s.parts else ""
        lines.append(f"  stage {s.stage} ({s.layers} layers, {s.in_flight:g} microbatches in flight{pending}): "
                     f"{s.total / GB:.1f} GB = {parts}")
    peak = plan.peak_stage
    top = peak.largest(3)
    lines.append("  largest contributors (stage %d): %s" % (
        peak.stage, ", ".join(f"{k} {v / GB:.1f} GB" for k, v in top)))
    for k, _ in top:
        hint = hint_for(k, job)
        if hint:
            lines.append(f"  - {k}: try {hint}")
    lines.append("  or run with action=search to list layouts that fit; force=true renders anyway.")
    return "\n".join(lines)
