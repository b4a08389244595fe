"""Pipeline timelines, simulated or executed: one format, one Chrome/Perfetto trace writer, one drawing.

A timeline is, per pipeline rank, a list of spans ``(kind, microbatch, chunk, start_s, end_s)``. Compute
kinds are F, B, W and BW (a backward computing both gradients, 1F1B/interleaved); communication kinds are
``send_fwd``, ``send_bwd``, ``recv_fwd``, ``recv_bwd`` and ``wait`` (a rank blocked on its sends at the end).
The planner turns its simulated ``SimResult`` into this format; the rank wing's recorder writes what it ran.
Torch-free; matplotlib is imported only by :func:`draw`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, List, Sequence, Tuple

Span = Tuple[str, int, int, float, float]
"""(kind, microbatch, chunk, start seconds, end seconds)."""
COMPUTE = ("F", "B", "W", "BW")
COLORS = {"F": "#4878d0", "B": "#6acc64", "W": "#ee854a", "BW": "#2a9d8f",
          "send_fwd": "#bbbbbb", "send_bwd": "#bbbbbb", "recv_fwd": "#dddddd", "recv_bwd": "#dddddd",
          "wait": "#eeeeee"}
LABEL_LIMIT = 600
"""Panels with more spans than this are drawn without microbatch numbers."""


def compute_order(spans: Iterable[Span]) -> List[Tuple[str, int, int]]:
    """The (kind, microbatch, chunk) of the compute spans in start order: what the schedule ran."""
    return [(k, mb, c) for k, mb, c, _, _ in sorted(spans, key=lambda s: s[3]) if k in COMPUTE]


def busy_seconds(spans: Iterable[Span]) -> float:
    return sum(end - start for kind, _, _, start, end in spans if kind in COMPUTE)


def window(timelines: Sequence[Sequence[Span]]) -> Tuple[float, float]:
    """(earliest start, latest end) over all ranks."""
    spans = [s for tl in timelines for s in tl]
    return (min(s[3] for s in spans), max(s[4] for s in spans)) if spans else (0.0, 0.0)


def idle_fraction(timelines: Sequence[Sequence[Span]]) -> float:
    """Idle share of rank-time over the pipeline's span: 1 - compute / (ranks x makespan). Communication
    and waiting count as idle (that is what a bubble is)."""
    start, end = window(timelines)
    total = len(timelines) * (end - start)
    return 1.0 - sum(busy_seconds(tl) for tl in timelines) / total if total > 0 else 0.0


def from_simulation(sim_timelines) -> List[List[Span]]:
    """The planner's ``SimResult.timelines`` (Span objects with .op, .start, .end) in this format."""
    return [[(s.op.kind, s.op.microbatch, s.op.chunk, float(s.start), float(s.end)) for s in tl]
            for tl in sim_timelines]


def chrome_trace(panels: Sequence[Tuple[str, Sequence[Sequence[Span]]]], unit_s: float = 1.0) -> dict:
    """Chrome/Perfetto trace (``chrome://tracing``, ui.perfetto.dev): one process per schedule, one thread
    per rank (compute) plus one per rank for communication; times in microseconds (``unit_s`` seconds per
    timeline unit: 1 for executed runs, any scale for simulated unit costs)."""
    events = []
    for pid, (title, timelines) in enumerate(panels):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": title}})
        for rank, spans in enumerate(timelines):
            for tid, label in ((2 * rank, f"rank {rank}"), (2 * rank + 1, f"rank {rank} p2p")):
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
            for kind, mb, chunk, start, end in spans:
                name = f"{kind}{mb}" + (f".{chunk}" if chunk else "")
                events.append({"ph": "X", "name": name, "cat": kind, "pid": pid,
                               "tid": 2 * rank + (kind not in COMPUTE), "ts": start * unit_s * 1e6,
                               "dur": max(end - start, 0.0) * unit_s * 1e6,
                               "args": {"microbatch": mb, "chunk": chunk}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: Path, panels, unit_s: float = 1.0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_beside(path)
    tmp.write_text(json.dumps(chrome_trace(panels, unit_s)))
    os.replace(tmp, path)
    return path


def _tmp_beside(path: Path) -> Path:
    """Where a file is written before ``os.replace`` publishes it: a reader never sees half a trace or picture."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def draw(path: Path, panels: Sequence[Tuple[str, Sequence[Sequence[Span]]]], time_label: str = "time") -> Path:
    """A PNG: one panel per schedule (title includes the idle fraction), one row per rank; F/B/W/BW blocks
    labelled with their microbatch, communication as thin grey bars, idle time left blank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ranks = max(len(tl) for _, tl in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 0.55 * ranks * len(panels) + 1.2 * len(panels)),
                             squeeze=False)
    for ax, (title, timelines) in zip(axes[:, 0], panels):
        t0, t1 = window(timelines)
        label = sum(len(tl) for tl in timelines) <= LABEL_LIMIT  # text is what makes big drawings slow
        for rank, spans in enumerate(timelines):
            y = len(timelines) - 1 - rank
            by_kind: dict = {}
            for kind, mb, chunk, start, end in spans:
                by_kind.setdefault(kind, []).append((start - t0, end - start))
                if label and kind in COMPUTE and (end - start) > (t1 - t0) / 120:
                    ax.text((start + end) / 2 - t0, y + 0.5, f"{mb}" + (f".{chunk}" if chunk else ""),
                            ha="center", va="center", fontsize=7, color="white")
            for kind, ranges in by_kind.items():  # one collection per rank and kind
                compute = kind in COMPUTE
                h, off = (0.8, 0.1) if compute else (0.15, 0.0)
                ax.broken_barh(ranges, (y + off, h), facecolors=COLORS.get(kind, "#999999"),
                               edgecolor="white" if compute else "none", linewidth=0.5)
        ax.set_yticks([len(timelines) - 1 - r + 0.5 for r in range(len(timelines))])
        ax.set_yticklabels([f"rank {r}" for r in range(len(timelines))])
        ax.set_xlim(0, t1 - t0)
        ax.set_title(f"{title}: idle fraction {idle_fraction(timelines):.3f}, makespan {t1 - t0:.4g}",
                     fontsize=10, loc="left")
        ax.set_xlabel(time_label, fontsize=8)
    kinds = sorted({s[0] for _, tl in panels for spans in tl for s in spans}, key=list(COLORS).index)
    fig.legend(handles=[Patch(color=COLORS[k], label=k) for k in kinds], loc="upper right", ncol=len(kinds),
               fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    tmp = _tmp_beside(path)
    fig.savefig(tmp, dpi=110, format="png")
    os.replace(tmp, path)
    plt.close(fig)
    return path
