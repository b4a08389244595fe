"""Pipeline schedules as per-rank operation orders, torch-free: what the planner simulates and the ranks execute.

A schedule is, for every pipeline rank, an ordered list of ``Op(kind, microbatch, chunk)``: F (forward),
B (backward: input gradient only), W (weight gradient) or BW (both gradients in one backward, as 1F1B and
interleaved run it). ``launcher.plan.simulator`` replays these lists with costs; the rank wing's ZB-H1
executor (``launcher/rank/zero_bubble.py``) runs exactly the list ``schedule_zb_h1`` returns, and the
executed-timeline test checks that what ran is this order. One definition, read by both wings.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    """One scheduled operation of a pipeline rank."""

    kind: str
    """F, B, W, or BW (a backward that computes both gradients before sending: 1F1B and interleaved)."""
    microbatch: int
    """Microbatch index, 0-based."""
    chunk: int = 0
    """Model chunk (virtual pipeline stage) on this rank, 0-based."""


# ------------------------------------------------------------------------------------------- schedules
def schedule_1f1b(p: int, m: int) -> list[list[Op]]:
    """Megatron's non-interleaved 1F1B: rank r warms up with min(p - r - 1, m) forwards, then alternates
    one forward and one backward (BW: input and weight gradients before the send), then cools down with the remaining backwards."""
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        ops = [Op("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops.append(Op("F", warm + i))
            ops.append(Op("BW", i))
        ops += [Op("BW", i) for i in range(m - warm, m)]
        out.append(ops)
    return out


def schedule_zb_h1(p: int, m: int) -> list[list[Op]]:
    """ZB-H1 (Qi et al., ICLR 2024, Fig. 3): 1F1B's order of F and B (so at most p - r microbatches in flight
    on rank r, 1F1B's activations), with the weight-gradient passes split off and rank r running its W's r
    microbatches late (so rank r also holds up to r + 1 microbatches' weight-gradient operands: the planner
    counts them, launcher/plan/memory.py). The deferred W's fill the time rank r would wait for the next B from downstream,
    which shrinks the bubble from (p-1)(T_F+T_B+T_W) to (p-1)(T_F+T_B-T_W); the remaining W's run at the end."""
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        ops = [Op("F", i) for i in range(warm)]
        backwards = 0
        w_next = 0
        for i in range(m):
            if warm + i < m:
                ops.append(Op("F", warm + i))
            ops.append(Op("B", i))
            backwards += 1
            if backwards - w_next > r:  # keep exactly r weight-gradient passes pending
                ops.append(Op("W", w_next))
                w_next += 1
        ops += [Op("W", j) for j in range(w_next, m)]
        out.append(ops)
    return out


def schedule_interleaved(p: int, m: int, v: int, group: int | None = None) -> list[list[Op]]:
    """Megatron's interleaved 1F1B: microbatches run in groups of ``group`` (default p) per model chunk;
    rank r warms up with 2(p - r - 1) + (v - 1) * group chunk-forwards, then alternates 1F and 1BW."""
    group = group or p
    total = m * v

    def chunk_of(k: int, forward: bool) -> tuple[int, int]:
        """k-th chunk-op of a rank -> (microbatch, chunk), in Megatron's ordering."""
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


def build_schedule(kind: str, p: int, m: int, v: int = 1, group: int | None = None) -> list[list[Op]]:
    """The per-rank op lists for schedule ``kind`` (1f1b, interleaved, zb_h1)."""
    if kind == "interleaved" and v > 1:
        return schedule_interleaved(p, m, v, group)
    if kind == "zb_h1":
        return schedule_zb_h1(p, m)
    return schedule_1f1b(p, m)
