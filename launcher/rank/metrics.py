"""Per-step metrics: stdout line, TensorBoard, wandb (optional), and the end-of-run report (rank 0)."""
from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from typing import Dict, List, Optional

import torch

from launcher.schema import LoggingConfig


def memory_gib() -> float:
    """Peak memory of this process: max_memory_allocated on GPU, peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def static_bytes(model, optimizer) -> dict:
    """Bytes this rank holds for weights, the DDP gradient buffers and the optimizer state (Adam moments, fp32
    master copies), counted on the tensors themselves: the planner's static memory per rank, which a CPU run can
    check where its peak (RSS: the interpreter and libraries included) cannot. Chained optimizers' state counts
    once it exists (after the first step)."""
    weights = sum(p.numel() * p.element_size() for ddp in model for p in ddp.module.parameters())
    grads = sum(_grad_bytes(ddp) for ddp in model)
    opt = 0
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(o, "optimizer", None)
        for state in (inner.state.values() if inner is not None else []):
            opt += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            for group in getattr(o, name, None) or []:  # None entries: a shard the CPU offload's
                # HybridDeviceOptimizer holds itself (train.optimizer_cpu_offload; its state counts above)
                opt += sum(p.numel() * p.element_size() for p in group if p is not None)
    return {"weights": weights, "grads": grads, "optimizer": opt}


def _grad_bytes(ddp) -> int:
    """The gradient buffers of one model chunk: Megatron-Core DDP's ``buffers`` and ``expert_parallel_buffers``
    (lists of _ParamAndGradBuffer, distributed_data_parallel.py), or Megatron-FSDP's sharded ``main_grad_buffer``
    per parameter group (its ``param_and_grad_buffer``; FSDP has no ``buffers`` list, and ``nn.Module.buffers`` is
    a method there)."""
    fsdp = getattr(ddp, "param_and_grad_buffer", None)
    if fsdp is not None:
        bufs = [g.main_grad_buffer for g in fsdp.parameter_groups if g.main_grad_buffer is not None]
        return sum(b.data.numel() * b.data.element_size() for b in bufs if b.data is not None)
    lists = [getattr(ddp, name, None) for name in ("buffers", "expert_parallel_buffers")]
    held = [b for bufs in lists if isinstance(bufs, (list, tuple)) for b in bufs]
    return sum(b.grad_data.numel() * b.grad_data.element_size() for b in held)


def memory_by_stage(pp_rank: int, model=None, optimizer=None) -> List[dict]:
    """Collective over the world: every rank's peak memory (``memory_gib``, and on GPU the caching allocator's
    peak reservation), gathered; returns, per pipeline stage, the largest over that stage's ranks (what the planner
    predicts per stage: launcher/plan/memory.py). Every rank gets the same list; rank 0 writes it into the run's
    report, where the GPU lane and action=bench compare it with the plan. With ``model`` and ``optimizer``, each
    entry also holds that rank's :func:`static_bytes`."""
    import torch.distributed as dist

    mine = {"stage": pp_rank, "rank": dist.get_rank(), "peak_gib": memory_gib(),
            "reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else None}
    if model is not None and optimizer is not None:
        mine["static_bytes"] = static_bytes(model, optimizer)
    everyone: List[Optional[dict]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out = []
    for stage in sorted({r["stage"] for r in everyone}):
        top = max((r for r in everyone if r["stage"] == stage), key=lambda r: r["peak_gib"])
        out.append({**top, "basis": "max_memory_allocated" if torch.cuda.is_available() else "peak RSS"})
    return out


def measure_cpu_matmul_tflops(seconds: float = 0.3, n: int = 512) -> float:
    """This rank's share of the CPU's fp32 matmul throughput, measured with every rank of the node running it
    at the same time (the caller puts a barrier before): the peak a CPU rank can reach, in TFLOP/s."""
    import time

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up (allocation, thread pool)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        done += 1
    return 2 * n**3 * done / (time.perf_counter() - start) / 1e12


MFU_LABEL = "MFU"
MFU_FP8_LABEL = "MFU vs BF16 peak"
"""The label on FP8 runs: the denominator stays the dense BF16 peak (NVIDIA's and Megatron-Bridge's published MFU,
and the planner's), about half the FP8 peak, so an FP8 run's figure is not a share of its own FP8 peak."""


def utilisation_basis(*, peak_tflops_bf16: float, on_gpu: bool, fp8: Optional[str] = None) -> tuple[float, str]:
    """(peak TFLOP/s per rank, label) that the logged utilisation is measured against.

    On GPU: the cluster profile's dense BF16 peak (MFU, as NVIDIA and Megatron report it), also on FP8 runs
    (``fp8``: precision.fp8, the recipe or None), whose label then says so. On CPU a GPU peak means nothing: the
    run is fp32 and its ranks share the cores, so measure the per-rank share instead."""
    if on_gpu:
        return peak_tflops_bf16, MFU_FP8_LABEL if fp8 else MFU_LABEL
    return measure_cpu_matmul_tflops(), "util vs measured CPU share"


STEP_LINE_KEYS = frozenset({"step", "loss", "lr", "grad_norm", "ms_per_step", "tokens_per_s", "tflops", "mfu",
                            "mem_gib"})
"""The step line's fixed fields; any other metric (MoE load-balancing / z-loss, ``mtp_N loss``: Megatron-LM's
training_log names) is appended after them, so tests/_rank_harness.py's STEP regex still parses the line."""


class MetricsLogger:
    """Rank 0 prints and records; other ranks only keep quiet."""

    def __init__(self, *, logging: LoggingConfig, bundle: Path, run_name: str, config: dict, rank: int,
                 console, peak_tflops: float, util_label: str):
        self.cfg, self.bundle, self.rank, self.console = logging, Path(bundle), rank, console
        self.peak_tflops, self.util_label = peak_tflops, util_label
        self.history: List[Dict[str, float]] = []
        self.evals: List[Dict[str, float]] = []
        self.tb = self.wandb = None
        if rank != 0:
            return
        if logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.bundle / "tensorboard"))
        if logging.wandb_project:
            self.wandb = _init_wandb(logging, self.bundle, run_name, config)

    def step(self, metrics: Dict[str, float]) -> None:
        if self.rank != 0:
            return
        metrics = {**metrics, "mfu": metrics["tflops"] / self.peak_tflops if self.peak_tflops else 0.0}
        self.history.append(metrics)
        step = int(metrics["step"])
        if step % max(1, self.cfg.log_interval) == 0:
            self.console.line(
                "step {step:5d} | loss {loss:.4f} | lr {lr:.3e} | grad_norm {grad_norm:.3f} | "
                "{ms_per_step:.1f} ms/step | tokens/s {tokens_per_s:.0f} | TFLOP/s {tflops:.4f} | "
                "{label} {mfu:.2%} | mem {mem_gib:.2f} GiB".format(label=self.util_label, **metrics)
                + "".join(f" | {k} {metrics[k]:.4f}" for k in metrics if k not in STEP_LINE_KEYS))
        self._record(metrics, "train", step)

    def eval(self, step: int, loss: float) -> None:
        if self.rank != 0:
            return
        self.evals.append({"step": step, "loss": loss})
        self.console.line(f"eval  {step:5d} | valid loss {loss:.4f}")
        self._record({"loss": loss}, "valid", step)

    def _record(self, metrics: Dict[str, float], prefix: str, step: int) -> None:
        scalars = {f"{prefix}/{k}": v for k, v in metrics.items() if k != "step"}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self, final: Optional[Dict[str, float]] = None) -> None:
        if self.rank != 0:
            return
        if final is not None:
            write_report(self.bundle / "report", self.history, self.evals, final)
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def summary(history: List[dict], evals: List[dict], *, status: str, steps: int, world: int,
            flops_per_token: float, peak_tflops: float, util_label: str,
            stages: Optional[List[dict]] = None) -> Dict[str, float]:
    """Final numbers for report/metrics.json; throughput averaged over the second half (past warm-up);
    ``stages``: :func:`memory_by_stage`."""
    final: Dict[str, float] = {"status": status, "steps": steps, "world_size": world,
                               "flops_per_token": flops_per_token, "mfu_basis": util_label,
                               "mfu_peak_tflops_per_rank": peak_tflops}
    if stages is not None:
        final["memory_by_stage"] = stages
    if history:
        tail = history[len(history) // 2:] if len(history) > 2 else history
        final.update(first_loss=history[0]["loss"], final_loss=history[-1]["loss"],
                     peak_mem_gib=max(h["mem_gib"] for h in history),
                     **{k: sum(h[k] for h in tail) / len(tail)
                        for k in ("ms_per_step", "tokens_per_s", "tflops", "mfu")})
    if evals:
        final["final_valid_loss"] = evals[-1]["loss"]
    return final


def _init_wandb(logging: LoggingConfig, bundle: Path, run_name: str, config: dict):
    """wandb run; offline unless configured otherwise. The API key is read by wandb from WANDB_API_KEY."""
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(project=logging.wandb_project, entity=logging.wandb_entity, mode=logging.wandb_mode,
                      name=run_name, dir=str(bundle), config=config)


def write_report(report_dir: Path, history: List[dict], evals: List[dict], final: Dict[str, float]) -> None:
    """report/metrics.json (final numbers + per-step history) and report/training.png."""
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "metrics.json").write_text(json.dumps(
        {"final": final, "steps": history, "eval": evals}, indent=2) + "\n")
    if not history:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    # fixed margins, not tight_layout(): its text-extent pass was 40% of the report's 0.85 CPU s, on every run
    fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw=dict(
        left=0.08, right=0.98, bottom=0.13, top=0.92, wspace=0.28))
    ax_loss.plot(steps, [h["loss"] for h in history], label="train")
    if evals:
        ax_loss.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", label="valid")
    ax_loss.set(xlabel="step", ylabel="loss", title="Loss")
    ax_loss.legend()
    ax_tput.plot(steps, [h["tokens_per_s"] for h in history])
    ax_tput.set(xlabel="step", ylabel="tokens/s", title="Throughput")
    fig.savefig(report_dir / "training.png", dpi=80)
    plt.close(fig)
