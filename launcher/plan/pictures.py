"""``action=plan`` pictures: the chosen layout's pipeline under 1F1B, interleaved and ZB-H1, side by side.

Each schedule is the core's op order (``launcher.core.pipeline.schedules``) replayed by the simulator with the
planner's own per-stage F/B/W times for this job (``timing.step_time``), drawn and traced with the same
code that draws a real run's recorded timeline (``launcher.core.pipeline.timeline``). Interleaved uses the job's
virtual stages, or 2 when the job has none (and is left out when the microbatches do not divide into
groups of PP). Long runs are drawn with at most ``MAX_MICROBATCHES`` microbatches (said in the title).
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

from launcher.core import Layout, derive
from launcher.core.pipeline import timeline
from launcher.schema import JobConfig, Schedule

MAX_MICROBATCHES = 16


def schedule_panels(job: JobConfig, lay: Layout | None = None) -> List[Tuple[str, list]]:
    """[(title, per-rank timelines)] for 1f1b, interleaved and zb_h1 at this job's layout (``lay``: derived if
    None)."""
    from launcher.plan.simulator import simulate_kind
    from launcher.plan.timing import step_time

    lay = lay or derive(job)
    p, m = lay.pp, min(max(1, lay.microbatches), MAX_MICROBATCHES)
    stages = step_time(job, lay).stages
    fs, bs, ws = ([s[i] for s in stages] for i in range(3))
    v = lay.vpp if lay.vpp > 1 else 2
    shown = f"{m} microbatches" + (f" of {lay.microbatches}" if m < lay.microbatches else "")
    panels = []
    for kind in (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED, Schedule.ZB_H1):
        if kind == Schedule.INTERLEAVED and m % p:
            continue
        res = simulate_kind(kind, p, m, fs, bs, ws, v=v if kind == Schedule.INTERLEAVED else 1,
                            group=p if kind == Schedule.INTERLEAVED else None)
        name = f"interleaved (VPP={v})" if kind == Schedule.INTERLEAVED else kind
        panels.append((f"{name}, PP={p}, {shown}, simulated",
                       timeline.from_simulation(res.timelines)))
    return panels


def draw_job_schedules(job: JobConfig, out_dir: Path | None = None, lay: Layout | None = None) -> List[Path]:
    """Write ``<name>-schedules.png`` (the three panels; if matplotlib is installed) and
    ``<name>-schedules.trace.json`` under ``out_dir`` (default: the job's output_dir). Returns the paths
    written; none for PP=1. ``lay``: the job's layout, derived if None."""
    lay = lay or derive(job)
    if lay.pp < 2:
        return []
    out = Path(out_dir or job.output_dir)
    panels = schedule_panels(job, lay)
    paths = [timeline.write_trace(out / f"{job.name}-schedules.trace.json", panels)]
    try:
        paths.insert(0, timeline.draw(out / f"{job.name}-schedules.png", panels, time_label="seconds (predicted)"))
    except ImportError:  # the login-node install has no matplotlib: the trace still opens in Perfetto
        pass
    return paths
