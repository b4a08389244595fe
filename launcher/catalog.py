"""The recipe catalogue (`python -m launcher action=list`): every model we ship a recipe for, its parameter
counts, and its H100 and H200 layouts with what the planner predicts for them.

Each catalogue model has a base recipe (its H100 layout) and a ``<base>_h200`` variant (a small override of the
base: its H200 layout). The rows are planned here, on the login node, by the same ``plan_job`` as
``action=plan``; nothing here imports torch or megatron.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from launcher.config import compose_jobs
from launcher.core import derive
from launcher.plan import plan_job
from launcher.plan.memory import param_count
from launcher.schema import JobConfig


@dataclass(frozen=True)
class Entry:
    """One catalogue model."""

    title: str
    """What the table calls the model."""
    recipe: str
    """Its base recipe (``recipes/recipe/<recipe>.yaml``)."""
    variants: tuple = ("",)
    """Recipe-name suffixes of its layouts, one row each: "" the base, "_h200" its H200 variant."""


CATALOGUE = (
    Entry("Llama 3 8B", "llama3_8b", ("", "_h200")),
    Entry("Llama 3 70B", "llama3_70b", ("", "_h200")),
    Entry("Llama 3.1 405B", "llama405b", ("", "_h200")),
    Entry("Mixtral 8x7B", "mixtral", ("", "_h200")),
    Entry("DeepSeek-V3", "deepseek_v3", ("", "_h200")),
    Entry("Qwen3-30B-A3B", "qwen3_30b_a3b", ("", "_h200")),
    Entry("Qwen3-235B-A22B", "qwen3_235b_a22b", ("", "_h200")),
    Entry("GPT-3 175B", "gpt3", ("", "_h200")),
    Entry("smoke (CPU)", "smoke"),
)
"""The catalogue, in the order it is listed."""


@dataclass(frozen=True)
class Row:
    """One layout of one catalogue model, as planned."""

    title: str
    recipe: str
    gpu: str
    nodes: int
    layout: str
    """TP/PP/VPP/CP/EP/DP (and FSDP, MoE all-to-all overlap)."""
    micro_batch: int
    recompute: str
    precision: str
    """The FP8 recipe ("fp8 delayed") or the dtype."""
    params: dict
    """``launcher.plan.memory.param_count`` of the model (total, active, mtp, ...)."""
    peak_gb: float
    gpu_memory_gb: float
    fits: bool
    tflops_per_gpu: float
    tokens_per_s: float


def layout_text(job: JobConfig) -> str:
    """The parallel layout in one short line: 'TP8 PP8 VPP16 DP8', 'TP1 PP1 EP8 DP64 a2a-overlap'."""
    lay = derive(job)
    sizes = [f"TP{lay.tp}", f"PP{lay.pp}"] + ([f"VPP{lay.vpp}"] if lay.vpp > 1 else []) \
        + ([f"CP{lay.cp}"] if lay.cp > 1 else []) + ([f"EP{lay.ep}"] if lay.ep > 1 else []) + [f"DP{lay.dp}"]
    sizes += ["FSDP"] if job.parallel.megatron_fsdp else []
    sizes += ["a2a-overlap"] if job.parallel.moe_a2a_overlap else []
    return " ".join(sizes)


def precision_text(job: JobConfig) -> str:
    return f"fp8 {job.precision.fp8}" if job.precision.fp8 else job.precision.dtype


def plan_row(entry: Entry, recipe: str, job: JobConfig) -> Row:
    """Plan one recipe (composed as ``job``) of the catalogue."""
    plan = plan_job(job)
    return Row(title=entry.title, recipe=recipe, gpu=job.cluster.gpu, nodes=job.nodes, layout=layout_text(job),
               micro_batch=job.train.micro_batch_size, recompute=job.train.recompute, precision=precision_text(job),
               params=param_count(job.model), peak_gb=plan.peak_gb, gpu_memory_gb=plan.gpu_memory_gb,
               fits=plan.fits, tflops_per_gpu=plan.perf["tflops_per_gpu"], tokens_per_s=plan.perf["tokens_per_s"])


def catalogue_rows(entries: tuple = CATALOGUE) -> list[Row]:
    """Every layout of every catalogue model, planned."""
    pairs = [(e, e.recipe + suffix) for e in entries for suffix in e.variants]
    jobs = compose_jobs([[f"recipe={recipe}"] for _, recipe in pairs])
    return [plan_row(e, recipe, job) for (e, recipe), job in zip(pairs, jobs)]


def _billions(n: float) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def params_text(params: dict) -> str:
    """'671.0B / 37.6B +11.6B MTP': total (main model) / active, MTP modules apart."""
    text = _billions(params["main"])
    if params["active"] < params["main"]:
        text += f" / {_billions(params['active'])}"
    if params["mtp"]:
        text += f" +{_billions(params['mtp'])} MTP"
    return text


def table(rows: list[Row], title: Optional[str] = None):
    """The catalogue as a rich table: one row per layout, the model named on its first."""
    from rich.markup import escape  # names and layouts are data, not rich markup
    from rich.table import Table

    out = Table(title=title or "recipe catalogue: planner predictions (not measurements) per layout")
    for column, justify in (("model", "left"), ("params total / active", "left"), ("recipe", "left"),
                            ("GPU", "left"), ("nodes", "right"), ("layout", "left"), ("mbs", "right"),
                            ("recompute", "left"), ("precision", "left"), ("GB/GPU", "right"),
                            ("TFLOP/s/GPU", "right"), ("tokens/s", "right")):
        out.add_column(column, justify=justify, no_wrap=True)
    previous = None
    for r in rows:
        first = r.title != previous
        previous = r.title
        colour = "green" if r.fits else "red"
        out.add_row(escape(r.title) if first else "", params_text(r.params) if first else "", escape(r.recipe),
                    escape(r.gpu), str(r.nodes), escape(r.layout), str(r.micro_batch), escape(r.recompute),
                    escape(r.precision),
                    f"[{colour}]{r.peak_gb:.1f}/{r.gpu_memory_gb:g}[/]",
                    f"{r.tflops_per_gpu:.0f}" if r.tflops_per_gpu >= 10 else f"{r.tflops_per_gpu:.2f}",
                    f"{r.tokens_per_s:,.0f}")
    return out


def print_table(rows: list[Row]) -> None:
    """Print the table at its natural width: one line per layout, nothing cut."""
    from rich.console import Console
    from rich.measure import Measurement

    out = table(rows)
    wide = Console(width=400)
    Console(width=Measurement.get(wide, wide.options, out).maximum).print(out)
