"""Pipeline-schedule simulator: 1F1B, interleaved (virtual stages), ZB-H1 and ZB-V (zero bubble, Qi et al. 2024).

A schedule is, for every pipeline rank, an ordered list of operations ``Op(kind, microbatch, chunk)`` with kind
F (forward), B (backward: input gradient) or W (weight gradient). ``simulate`` replays those lists event by
event: a rank runs its next operation as soon as the rank is free and the operation's inputs exist:

- F of model chunk c (virtual stage k = chunk * p + rank; ZB-V: rank or 2p - 1 - rank) needs F of virtual stage k - 1 on its rank, plus a
  send/recv of ``t_comm``;
- B of virtual stage k needs B of virtual stage k + 1 (+ ``t_comm``), or its own F on the last virtual stage;
- W needs its own B.

It returns the makespan, the bubble fraction (idle share of rank-time), each rank's op timeline, and the peak
number of microbatches in flight (forwards whose backward has not finished: what holds activation memory).
1F1B runs B and W back to back; the others order ops as their papers/implementations do. Costs may differ
per rank (uneven stages). Pure Python; used by the planner and, later, to check the real ZB-H1 schedule.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from launcher.core.pipeline.schedules import (  # noqa: F401  (re-exported: the planner's names)
    Op, build_schedule, schedule_1f1b, schedule_interleaved, schedule_zb_h1, schedule_zb_v, stage_of)
from launcher.schema import Schedule


@dataclass
class Span:
    """An executed op with its start and end time."""

    op: Op
    start: float
    end: float


@dataclass
class SimResult:
    """Outcome of replaying a schedule."""

    makespan: float
    """Time from the first op to the last op's end."""
    bubble_fraction: float
    """Idle rank-time / total rank-time (p x makespan)."""
    timelines: list[list[Span]] = field(default_factory=list)
    """Per rank, the executed ops in order."""
    peak_in_flight: list[int] = field(default_factory=list)
    """Per rank, the most microbatch-chunks whose F had run and whose B had not finished."""

    @property
    def bubble(self) -> float:
        """Makespan minus the busiest rank's compute time: the closed forms' (p-1)(...) quantity."""
        return self.makespan - max(sum(s.end - s.start for s in tl) for tl in self.timelines)

    def to_dict(self) -> dict:
        return {"makespan": self.makespan, "bubble_fraction": self.bubble_fraction,
                "peak_in_flight": self.peak_in_flight,
                "timelines": [[[s.op.kind, s.op.microbatch, s.op.chunk, s.start, s.end] for s in tl]
                              for tl in self.timelines]}


# ------------------------------------------------------------------------------------------- simulation
def _per_rank(x: float | Sequence[float], p: int) -> list[float]:
    return list(x) if isinstance(x, (list, tuple)) else [float(x)] * p


def simulate(schedule: list[list[Op]], t_f: float | Sequence[float], t_b: float | Sequence[float],
             t_w: float | Sequence[float], t_comm: float = 0.0, placement: str = Schedule.INTERLEAVED,
             durations: Sequence[Sequence[float]] | None = None) -> SimResult:
    """Replay per-rank op lists; costs are per model chunk, scalars or one value per rank. ``placement``: how
    chunks map to pipeline stages (``launcher.core.pipeline.schedules.stage_of``: interleaved, or zb_v's V).
    ``durations[r][i]``, when given, is the cost of rank r's i-th op instead (measured ops replayed through the
    same dependencies: :func:`replay`)."""
    p = len(schedule)
    if durations is not None and [len(d) for d in durations] != [len(ops) for ops in schedule]:
        raise ValueError(f"durations: {[len(d) for d in durations]} per rank for {[len(o) for o in schedule]} ops")
    v = 1 + max((op.chunk for ops in schedule for op in ops), default=0)
    cost = {"F": _per_rank(t_f, p), "B": _per_rank(t_b, p), "W": _per_rank(t_w, p)}
    cost["BW"] = [b + w for b, w in zip(cost["B"], cost["W"])]
    n_virtual = p * v
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, microbatch) -> end time
    clock = [0.0] * p
    pos = [0] * p
    timelines: list[list[Span]] = [[] for _ in range(p)]
    in_flight = [0] * p
    peak = [0] * p
    remaining = sum(len(ops) for ops in schedule)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(schedule[r]):
                op = schedule[r][pos[r]]
                k = stage_of(placement, p, r, op.chunk)
                ready = _ready_time(op, k, r, n_virtual, done, t_comm)
                if ready is None:
                    break
                start = max(clock[r], ready)
                end = start + (cost[op.kind][r] if durations is None else durations[r][pos[r]])
                for kind in (("B", "W") if op.kind == "BW" else (op.kind,)):
                    done[(kind, k, op.microbatch)] = end
                timelines[r].append(Span(op, start, end))
                clock[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
                if op.kind == "F":
                    in_flight[r] += 1
                    peak[r] = max(peak[r], in_flight[r])
                elif op.kind in ("B", "BW"):
                    in_flight[r] -= 1
        if not progressed:
            stuck = {r: schedule[r][pos[r]] for r in range(p) if pos[r] < len(schedule[r])}
            raise ValueError(f"schedule deadlocks; next ops per rank: {stuck}")
    makespan = max(clock)
    busy = sum(s.end - s.start for tl in timelines for s in tl)
    bubble_fraction = 1.0 - busy / (p * makespan) if makespan else 0.0
    return SimResult(makespan, bubble_fraction, timelines, peak)


def replay(planned: list[list[Op]], executed: Sequence[Sequence[tuple]], durations: Sequence[Sequence[float]],
           placement: str = Schedule.INTERLEAVED, t_comm: float = 0.0, labels: bool = True) -> SimResult:
    """An executed step replayed with one core per rank: each rank's measured op costs (``durations``, e.g. the
    thread CPU seconds ``launcher.rank.zb_executor.Recorder.cpu_seconds`` gives) through the planned order and its
    dependencies (``simulate``). What a wall clock measures only when every rank has a core of its own; with ranks
    sharing cores, a descheduled rank's op looks long and the others' waits hide behind it.

    ``executed[r]``: rank r's compute spans ``(kind, microbatch, chunk, ...)`` in the order they ran. Their kinds
    must equal the planned ones, op by op; so must microbatch and chunk with ``labels`` (our executor labels its
    ops; Megatron's interleaved schedule recorded from outside only numbers calls: ``labels=False``)."""
    if len(executed) != len(planned):
        raise ValueError(f"executed: {len(executed)} ranks, planned: {len(planned)}")
    for r, (ops, ran) in enumerate(zip(planned, executed)):
        if [op.kind for op in ops] != [s[0] for s in ran]:
            raise ValueError(f"rank {r}: executed kinds {[s[0] for s in ran][:12]}... differ from the planned "
                             f"{[op.kind for op in ops][:12]}...")
        wrong = [(op, s[:3]) for op, s in zip(ops, ran) if labels and (op.microbatch, op.chunk) != tuple(s[1:3])]
        if wrong:
            raise ValueError(f"rank {r}: executed op {wrong[0][1]} where {wrong[0][0]} was planned")
    return simulate(planned, 0.0, 0.0, 0.0, t_comm, placement=placement, durations=durations)


def _ready_time(op: Op, k: int, r: int, n_virtual: int, done: dict, t_comm: float) -> float | None:
    """When op's inputs exist (None: not yet)."""
    mb = op.microbatch
    if op.kind == "F":
        if k == 0:
            return 0.0
        prev = done.get(("F", k - 1, mb))
        return None if prev is None else prev + t_comm
    if op.kind in ("B", "BW"):
        own = done.get(("F", k, mb))
        if own is None:
            return None
        if k == n_virtual - 1:
            return own
        nxt = done.get(("B", k + 1, mb))
        return None if nxt is None else max(own, nxt + t_comm)
    return done.get(("B", k, mb))  # W needs its own B


def simulate_kind(kind: str, p: int, m: int, t_f, t_b, t_w, v: int = 1, t_comm: float = 0.0,
                  group: int | None = None, costs: Sequence[float] | None = None) -> SimResult:
    """Build and replay schedule ``kind``; t_f/t_b/t_w are per microbatch per whole stage (divided by v
    for each model chunk of the interleaved schedule)."""
    vv = v if kind in (Schedule.INTERLEAVED, Schedule.ZB_H1) else 2 if kind == Schedule.ZB_V else 1
    scale = (lambda x: [c / vv for c in x]) if isinstance(t_f, (list, tuple)) else (lambda x: x / vv)
    # zb_v: the order the ranks run, generated for schedule.zb_v_costs (``costs``; None: equal costs)
    order = build_schedule(kind, p, m, vv, group, tuple(costs) if costs else (1.0, 1.0, 1.0))
    return simulate(order, scale(t_f), scale(t_b), scale(t_w), t_comm, placement=kind)
