"""The list-scheduling implementations of ``launcher.core.pipeline.schedules`` as they were before they were rewritten for
speed (float clock, a heap of events, an Op per decision): kept here, unchanged, as the straightforward reference
that tests/test_schedules_fast.py compares the fast versions with, op for op."""
from __future__ import annotations

import heapq

from launcher.core.pipeline.schedules import Op, stage_of
from launcher.schema import Schedule


def zb_h1_interleaved(p: int, m: int, v: int, group: int) -> tuple:
    base = schedule_interleaved(p, m, v, group)
    seq = [[Op("B" if op.kind == "BW" else "F", op.microbatch, op.chunk) for op in ops] for ops in base]
    n, inf = p * v, float("inf")
    f_end = [[inf] * m for _ in range(n)]  # [stage][microbatch] -> end time
    b_end = [[inf] * m for _ in range(n)]
    out: list[list[Op]] = [[] for _ in range(p)]
    free, pos = [0.0] * p, [0] * p
    pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # (microbatch, chunk) after B, before W
    total, count, t = 3 * m * v * p, 0, 0.0
    events: list = []

    def ready(r: int, op: Op) -> bool:
        k, mb = stage_of(Schedule.INTERLEAVED, p, r, op.chunk), op.microbatch
        if op.kind == "F":
            return k == 0 or f_end[k - 1][mb] <= t
        return f_end[k][mb] <= t and (k == n - 1 or b_end[k + 1][mb] <= t)

    while count < total:
        for r in range(p):
            if free[r] > t:
                continue
            if len(pending[r]) > r or (pending[r] and not (pos[r] < len(seq[r]) and ready(r, seq[r][pos[r]]))):
                choice = Op("W", *pending[r].pop(0))
            elif pos[r] < len(seq[r]) and ready(r, seq[r][pos[r]]):
                choice, pos[r] = seq[r][pos[r]], pos[r] + 1
                if choice.kind == "B":
                    pending[r].append((choice.microbatch, choice.chunk))
            else:
                continue
            out[r].append(choice)
            free[r] = t + 1.0
            k = stage_of(Schedule.INTERLEAVED, p, r, choice.chunk)
            if choice.kind == "F":
                f_end[k][choice.microbatch] = free[r]
            elif choice.kind == "B":
                b_end[k][choice.microbatch] = free[r]
            heapq.heappush(events, free[r])
            count += 1
        t = _next_event(events, t, count < total, f"zb_h1 over a virtual pipeline, p={p}, m={m}, v={v}")
    return tuple(tuple(ops) for ops in out)


def _next_event(events: list, t: float, more: bool, what: str) -> float:
    while events and events[0] <= t:
        heapq.heappop(events)
    if more and not events:
        raise RuntimeError(f"list scheduling is stuck: {what}")
    return events[0] if events else t


def schedule_interleaved(p: int, m: int, v: int, group: int | None = None) -> list[list[Op]]:
    group = group or p
    total = m * v

    def chunk_of(k: int, forward: bool) -> tuple[int, int]:
        g, rem = divmod(k, group * v)
        c = rem // group
        mb = g * group + rem % group
        return mb, (c if forward else v - 1 - c)

    out = []
    for r in range(p):
        warm = min(2 * (p - r - 1) + (v - 1) * group, total)
        ops = []
        f_k = b_k = 0
        for _ in range(warm):
            mb, c = chunk_of(f_k, True)
            ops.append(Op("F", mb, c))
            f_k += 1
        while b_k < total:
            if f_k < total:
                mb, c = chunk_of(f_k, True)
                ops.append(Op("F", mb, c))
                f_k += 1
            mb, c = chunk_of(b_k, False)
            ops.append(Op("BW", mb, c))
            b_k += 1
        out.append(ops)
    return out
