"""Zero-bubble memory states: what each rank of a ZB-H1 or ZB-V op list holds after each op, as (microbatches in
flight, microbatches whose weight gradient is still pending), and the states that can be a stage's peak.

The op lists are ``launcher.core.pipeline.schedules``' (the ones the rank executor runs literally), so planner and
executor read one schedule; ``launcher/plan/memory.py`` prices the states in bytes (activations per microbatch in
flight, the deferred weight-gradient operands per pending one) and takes the peak. Torch-free.
"""
from __future__ import annotations

import functools
import itertools

from launcher.core.pipeline.schedules import Op, schedule_zb_h1, schedule_zb_v


def held_after_each_op(ops: list[Op]) -> list[tuple[int, int]]:
    """(microbatches in flight, microbatches whose W is pending) after each op of one rank's op list.

    F puts a microbatch in flight (all its activations). B frees them except what its deferred weight-gradient
    GEMMs keep (``models/deferred_wgrad.py``: the W store holds each deferred linear's input and output gradient
    until that microbatch's W), so the microbatch moves from in flight to pending; W frees the oldest pending
    one; BW (1F1B) frees an in-flight one, nothing left pending. The state after a B is the one before the W
    that may follow it: the store then holds that B's W work too, its most."""
    in_flight = pending = 0
    out = []
    append = out.append
    for op in ops:  # a plain if-chain on the kind: this runs over every op of every exact op list the search builds
        kind = op.kind
        if kind == "F":
            in_flight += 1
        elif kind == "B":
            in_flight -= 1
            pending += 1
        elif kind == "W":
            pending -= 1
        elif kind == "BW":
            in_flight -= 1
        else:
            raise ValueError(f"op {op} is not F, B, W or BW")
        append((in_flight, pending))
    return out


_BIG = 1 << 32
_STEP = {"F": _BIG, "B": 1 - _BIG, "W": -1, "BW": -_BIG}
"""Each op's change of ``in_flight * _BIG + pending`` (``held_after_each_op``'s rules), for ``_distinct_held``."""


def _distinct_held(ops) -> tuple[tuple[int, int], ...]:
    """``tuple(sorted(set(held_after_each_op(ops))))`` at C speed (the search runs it over every op of every exact
    op list, 150k ops at PP 16 x VPP 6 x 512 microbatches): the state coded as one integer, in_flight * _BIG +
    pending, summed with itertools.accumulate; only the distinct codes are decoded. Exact while 0 <= pending <
    _BIG: a W only ever runs after its B, and no op list has 2**32 ops."""
    try:
        steps = [_STEP[op.kind] for op in ops]
    except KeyError:
        return tuple(sorted(set(held_after_each_op(ops))))  # raises held_after_each_op's one-line error
    return tuple(sorted(divmod(code, _BIG) for code in set(itertools.accumulate(steps))))


@functools.lru_cache(maxsize=256)
def zb_h1_states(p: int, m: int, v: int = 1, group: int | None = None) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per stage, the distinct (in flight, pending W) states of ``launcher.core.pipeline.schedules.schedule_zb_h1(p, m, v,
    group)``, the op list the rank executor runs literally (so planner and executor read one schedule); with
    ``v`` > 1 both count chunk-microbatches."""
    return tuple(_distinct_held(ops) for ops in schedule_zb_h1(p, m, v, group))


@functools.lru_cache(maxsize=256)
def zb_v_states(p: int, m: int, costs: tuple = (1.0, 1.0, 1.0)) -> tuple[tuple[tuple[int, int], ...], ...]:
    """``zb_h1_states`` for ``schedule_zb_v``: (chunk-microbatches in flight, chunk-microbatches with W pending)."""
    return tuple(_distinct_held(ops) for ops in schedule_zb_v(p, m, costs))


def _front(states) -> tuple:
    """The states no other state matches or exceeds in both counts, in ``states``' order: the only candidates for
    ``zb_peak_state``, whose memory grows with both (an op list of PP 16 x VPP 6 has hundreds of states a stage).

    One pass over the distinct states by falling first count (not every pair): a state is dominated iff a state of
    the same first count has a larger second one, or one of a larger first count has at least its second one."""
    keep = set()
    above = None  # the largest second count among states of a larger first count
    for first, group in itertools.groupby(sorted(set(states), reverse=True), key=lambda st: st[0]):
        top = next(group)  # the largest second count at this first count: the only one not dominated here
        if above is None or top[1] > above:
            keep.add(top)
            above = top[1]
    return tuple(s for s in states if s in keep)


@functools.lru_cache(maxsize=256)
def zb_h1_front(p: int, m: int, v: int = 1, group: int | None = None) -> tuple:
    """``zb_h1_states``' per-stage ``_front``."""
    return tuple(_front(st) for st in zb_h1_states(p, m, v, group))


@functools.lru_cache(maxsize=256)
def zb_v_front(p: int, m: int, costs: tuple = (1.0, 1.0, 1.0)) -> tuple:
    """``zb_v_states``' per-stage ``_front``."""
    return tuple(_front(st) for st in zb_v_states(p, m, costs))


def zb_v_bound_states(p: int, m: int) -> tuple[tuple[int, int], ...]:
    """States that dominate every (in flight, pending W) state ``schedule_zb_v(p, m, costs)`` reaches on any rank, for
    any costs: its F rule keeps at most 2p chunk-microbatches between F and W (``held < limit``), and there are 2m.
    The peak over these is never below the op list's (``zb_peak_state`` grows with both counts): what the search's
    first pass uses instead of generating the order at every candidate's microbatch count (up to 0.9 s each at PP8,
    512 microbatches); where this bound decides a fit, the exact op list decides it instead."""
    n = min(2 * p, 2 * m)
    return tuple((i, n - i) for i in range(n + 1))


@functools.lru_cache(maxsize=1024)
def zb_h1_bound_states(p: int, m: int, v: int = 1, group: int | None = None) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per stage, two states that dominate every (in flight, pending W) state of ``schedule_zb_h1(p, m, v, group)``:
    its F/B order is 1F1B's (v = 1: at most A = min(p - r, m) in flight on rank r) or Megatron's interleaved one
    (chunk-microbatches: warm-up 2(p - r - 1) + (v - 1) g, one more before the first B), rank r keeps at most
    W = r + 1 W's pending (r between W slots, one more right after a B, whose microbatch left the in-flight
    ones): so (A, W - 1) or (A - 1, W). The search's first pass uses them where the op list costs most to
    generate (PP 16, VPP 6, 512 microbatches: 0.3 s each); tests/test_zb_memory.py checks the domination."""
    g = group or p
    total = m * v
    out = []
    for r in range(p):
        a = min(p - r, m) if v == 1 else min(2 * (p - r - 1) + (v - 1) * g + 1, total)
        w = min(r + 1, total)
        out.append(((a, w - 1), (a - 1, w)))
    return tuple(out)


def zb_h1_reached_states(p: int, m: int, v: int = 1, group: int | None = None) -> tuple:
    """Per stage, two states ``schedule_zb_h1(p, m, v, group)`` certainly reaches on that rank: before its first B
    it runs only F's (no W is pending yet), A of them (``zb_h1_bound_states``' A: 1F1B's or interleaved's warm-up
    and one more), so (A, 0); the B makes it (A - 1, 1), counted before the W that may follow. The peak over these
    is never above the op list's: the search drops a candidate whose peak over these exceeds the GPU without
    building the op list (what the exact peak would decide, for a fraction of the time)."""
    return tuple(((a, 0), (a - 1, 1)) for (a, _), _ in zb_h1_bound_states(p, m, v, group))


def zb_peak_state(states, act_bytes: float, wgrad_bytes: float, while_in_flight: float = 0.0) -> tuple[int, int]:
    """The (in flight, pending W) state of most memory: in_flight * act_bytes + pending * wgrad_bytes, plus
    ``while_in_flight`` (the last stage's loss logits, held from its forward into its backward) when any
    microbatch is in flight."""
    return max(states, key=lambda st: st[0] * act_bytes + (while_in_flight if st[0] else 0.0) + st[1] * wgrad_bytes)
