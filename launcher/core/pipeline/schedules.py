"""Pipeline schedules as per-rank operation orders, torch-free: what the planner simulates and the ranks execute.

A schedule is, for every pipeline rank, an ordered list of ``Op(kind, microbatch, chunk)``: F (forward),
B (backward: input gradient only), W (weight gradient) or BW (both gradients in one backward, as 1F1B and
interleaved run it). ``launcher.plan.simulator`` replays these lists with costs; the rank wing's ZB-H1
executor (``launcher/rank/zb_executor.py``) runs exactly the list ``schedule_zb_h1`` returns, and the
executed-timeline test checks that what ran is this order. One definition, read by both wings.
"""
from __future__ import annotations

import collections
import functools
import heapq
from dataclasses import dataclass
from operator import add

from launcher.schema import Schedule


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


def schedule_zb_h1(p: int, m: int, v: int = 1, group: int | None = None) -> list[list[Op]]:
    """ZB-H1 (Qi et al., ICLR 2024, Fig. 3): 1F1B's order of F and B (so at most p - r microbatches in flight
    on rank r, 1F1B's activations), with the weight-gradient passes split off and rank r running its W's r
    microbatches late (so rank r also holds up to r + 1 microbatches' weight-gradient operands: the planner
    counts them, launcher/plan/memory.py). The deferred W's fill the time rank r would wait for the next B from downstream,
    which shrinks the bubble from (p-1)(T_F+T_B+T_W) to (p-1)(T_F+T_B-T_W); the remaining W's run at the end.

    With ``v`` > 1 model chunks per rank (a virtual pipeline, ``group`` as in :func:`schedule_interleaved`): the
    same rule over Megatron's interleaved order, :func:`_zb_h1_interleaved`."""
    if v > 1:
        if m % (group or p):  # validate refuses it, as for interleaved (whose order would name microbatches >= m)
            raise ValueError(f"zb_h1 over {v} chunks needs the microbatches ({m}) divisible by the microbatch "
                             f"group ({group or p})")
        return [list(ops) for ops in _zb_h1_interleaved(p, m, v, group or p)]
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


@functools.lru_cache(maxsize=256)
def _zb_h1_interleaved(p: int, m: int, v: int, group: int) -> tuple:
    """ZB-H1's rule over a virtual pipeline (ours; the paper builds ZB-H1 on 1F1B only): each rank runs
    Megatron's interleaved order of F and B (:func:`schedule_interleaved`, its BW split into B and W), so it holds
    interleaved 1F1B's activations, and its W's go where that order would leave it waiting: list scheduling at
    equal chunk costs (T_F = T_B = T_W, the paper's setting), where a rank that is free runs its next F/B if
    that op's input exists, else its oldest pending W; and, as in ZB-H1, rank r never keeps more than r W's
    pending (the one after the (r+1)-th runs first), which bounds the weight-gradient operands it holds to r + 1
    chunk-microbatches (1/v of a stage each). The W's left run at the end. At equal costs the bubble is about a
    third of interleaved 1F1B's (PP 8, VPP 4, 64 microbatches: 0.9% vs 2.7% of the step,
    tests/test_schedules_zb.py); the planner replays this order with its own stage costs.

    Written for speed (the search builds this order for every (p, m, v, group) whose exact memory it needs, up to
    PP 16 x VPP 6 x 512 microbatches, 150k ops): every op costs one time step, so the clock is an integer that
    advances by one per round and every rank is free at each round's start (its last op began in an earlier round);
    an op's inputs are looked up by precomputed flat indices into one array of end times; Op objects are shared
    (one per kind, microbatch and chunk; they are frozen). tests/test_schedules_fast.py checks it op for op against
    the straightforward version (a float clock, a heap of events, an Op per decision) kept in
    tests/_schedules_reference.py."""
    order = _interleaved_order(p, m, v, group)
    n = p * v
    size = n * m
    never = 1 << 62
    # end[k * m + mb]: when stage k's F of microbatch mb ended; end[size + k * m + mb]: its B; end[none] (always 0):
    # the input of an op with none (the first stage's F, the last stage's B from downstream); end[stop] (never): see
    # below
    none, stop = 2 * size, 2 * size + 1
    end = [never] * (2 * size) + [0, never]
    ops_f = [Op("F", mb, c) for mb in range(m) for c in range(v)]  # index mb * v + c
    ops_b = [Op("B", mb, c) for mb in range(m) for c in range(v)]
    ops_w = [Op("W", mb, c) for mb in range(m) for c in range(v)]
    # per rank, per op of its F/B order: (Op, end slot it writes, its two inputs' slots, its W or None for an F),
    # then one that never becomes ready (both inputs at ``stop``), so that "the next op" always exists
    plan = []
    for r in range(p):
        rank = []
        for forward, mb, c in order[r]:
            k = c * p + r  # stage_of(INTERLEAVED, p, r, c)
            if forward:
                rank.append((ops_f[mb * v + c], k * m + mb, (k - 1) * m + mb if k else none, none, None))
            else:
                rank.append((ops_b[mb * v + c], size + k * m + mb, k * m + mb,
                             size + (k + 1) * m + mb if k < n - 1 else none, ops_w[mb * v + c]))
        rank.append((None, stop, stop, stop, None))
        plan.append(rank)
    out: list[list[Op]] = [[] for _ in range(p)]
    pos = [0] * p
    pending = [collections.deque() for _ in range(p)]  # the W's of B's run, oldest first
    total, count, t = 3 * m * v * p, 0, 0
    ranks = list(zip(range(p), plan, pending, out))
    while count < total:
        ran = count
        for r, steps, pend, ops in ranks:
            op, slot, a, b, w = steps[pos[r]]
            ready = end[a] <= t and end[b] <= t
            if len(pend) > r or (pend and not ready):
                ops.append(pend.popleft())
            elif ready:
                pos[r] += 1
                end[slot] = t + 1  # > t: ranks after r in this round do not see it yet, as at equal end times
                if w is not None:
                    pend.append(w)
                ops.append(op)
            else:
                continue
            count += 1
        if count == ran and count < total:  # nothing ran and nothing is running: no op's input can ever appear
            raise RuntimeError(f"list scheduling is stuck: zb_h1 over a virtual pipeline, p={p}, m={m}, v={v}")
        t += 1
    return tuple(tuple(ops) for ops in out)


@functools.lru_cache(maxsize=256)
def _interleaved_order(p: int, m: int, v: int, group: int) -> tuple:
    """Per rank, Megatron's interleaved order as (forward, microbatch, chunk) triples (:func:`schedule_interleaved`,
    which wraps them in Op's): rank r warms up with 2(p - r - 1) + (v - 1) * group chunk-forwards, then alternates
    one forward and one backward. The k-th chunk-op of a rank is microbatch g * group + rem % group of chunk
    rem // group (counted from the last chunk for backwards), where (g, rem) = divmod(k, group * v)."""
    total = m * v
    span = group * v
    fwd = [(g * group + rem % group, rem // group) for g in range(-(-total // span)) for rem in range(span)][:total]
    out = []
    for r in range(p):
        warm = min(2 * (p - r - 1) + (v - 1) * group, total)
        ops = [(True, mb, c) for mb, c in fwd[:warm]]
        f_k = warm
        for mb, c in fwd:  # the b_k-th backward: the b_k-th forward's microbatch, its chunk mirrored
            if f_k < total:
                ops.append((True, *fwd[f_k]))
                f_k += 1
            ops.append((False, mb, v - 1 - c))
        out.append(tuple(ops))
    return tuple(out)


def _next_event(events: list, t: float, more: bool, what: str) -> float:
    """List scheduling's clock: the next time anything finishes after ``t`` (a rank frees, an input appears);
    ``events`` is the min-heap of op end times. ``more``: ops are left, so there must be one."""
    while events and events[0] <= t:
        heapq.heappop(events)
    if more and not events:
        raise RuntimeError(f"list scheduling is stuck: {what}")
    return events[0] if events else t


def schedule_interleaved(p: int, m: int, v: int, group: int | None = None) -> list[list[Op]]:
    """Megatron's interleaved 1F1B: microbatches run in groups of ``group`` (default p) per model chunk;
    rank r warms up with 2(p - r - 1) + (v - 1) * group chunk-forwards, then alternates 1F and 1BW."""
    shared: dict = {}  # one (frozen) Op per kind, microbatch and chunk: every rank runs each of them

    def op(forward: bool, mb: int, c: int) -> Op:
        key = (forward, mb, c)
        if key not in shared:
            shared[key] = Op("F" if forward else "BW", mb, c)
        return shared[key]
    return [[op(*x) for x in ops] for ops in _interleaved_order(p, m, v, group or p)]


def stage_of(kind: str, p: int, rank: int, chunk: int) -> int:
    """The pipeline stage (0 = embedding side, 2p - 1 or vp - 1 = loss side) that model chunk ``chunk`` of
    ``rank`` holds: interleaved places chunk c at c * p + rank; ZB-V places chunk 0 at rank and chunk 1 at
    2p - 1 - rank (a V: down the ranks and back up, so rank 0 holds both the first and the last stage)."""
    if kind == Schedule.ZB_V:
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def loss_rank(kind: str, p: int) -> int:
    """The pipeline rank holding the last stage (output layer, loss, MTP): p - 1, or 0 under ZB-V's V."""
    return 0 if kind == Schedule.ZB_V else p - 1


def place(kind: str, p: int, stage: int) -> tuple[int, int]:
    """(rank, chunk) holding pipeline ``stage``; the inverse of :func:`stage_of`."""
    if kind == Schedule.ZB_V:
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


def schedule_zb_v(p: int, m: int, costs: tuple = (1.0, 1.0, 1.0)) -> list[list[Op]]:
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): two model chunks per rank in a V
    (``stage_of``), backward split into B and W, at most 2p chunk-microbatches holding activations per rank
    (from F until W: 1F1B's peak, p microbatches of a whole stage, since a chunk is half a stage).

    Built by list scheduling with the chunk costs ``costs`` = (T_F, T_B, T_W) (default equal, the paper's
    setting): whenever a rank is free it runs, of the ops whose inputs exist, a B (oldest microbatch, the chunk
    nearer the loss first), else an F (chunk 1 first: it drains the V) if its memory allows, else its oldest
    pending W, else it waits for the next input; the W's left run at the end. Three settings bend that rule:
    with at least ``w_first`` chunk-microbatches held a pending W goes before a new F, below ``f_first`` a new F
    goes before a ready B, and with a ``slack`` the filler is chosen to end before the next B's inputs arrive
    (or the rank waits for them). Of the rules :func:`zb_v_variants` names, the order is the one with the
    shortest makespan at ``costs`` (as the paper's scheduler keeps the best of its heuristics): at p=4, m=8 and
    chunk costs (0.75, 1, 0.97) as measured on CPU, idle 6.6% against 9.0% for the plain rule, and at
    (1, 1, 0.5) 9.1% against 14.0% (interleaved: 15.8%). Ties keep the plain rule. The order is deterministic for
    given costs; a fixed order tuned to other costs leaves W-sized holes (the planner generates it from its own
    stage costs). The rank executor runs it literally, its p2p program from ``launcher.core.pipeline.p2p.plan``."""
    return [list(ops) for ops in _zb_v_ops(p, m, tuple(float(c) for c in costs))]


def zb_v_variants(p: int) -> list[tuple[int, int, float | None]]:
    """The (w_first, f_first, slack) rules :func:`schedule_zb_v` tries, the plain rule (2p, 0, None) first.

    slack None: a rank with no B ready runs a filler (F, else W) at once. slack s: it first looks at when its next
    B's inputs arrive (the list scheduler already knows the end time of every op it placed upstream) and runs a
    filler that ends by then (F first), else waits for the B when the gap is under s x the shortest filler, else
    runs the filler anyway: a W held back is a W that can fill a later hole. The twelve are a greedy cover of the
    best of 40 such rules over p = 2, 4, 8, 16, m = p..4p and chunk costs in {0.5, 0.75, 1}^3: mean makespan 0.003%
    above that best (the six threshold pairs without the look-ahead: 0.23%); at CPU's measured chunk costs
    (0.75, 1, 0.97), p=4, m=8, idle 6.6% against 8.4%."""
    rules = [(2 * p, 0, None), (p, 2 * p, None), (p, 0, 0.0), (p, 2 * p - 1, 0.5), (p, 2 * p, 1.0), (2 * p, 0, 1.0),
             (2 * p, 2 * p - 1, 0.5), (p, 2 * p - 1, None), (p, 2 * p, 0.5), (p, 2 * p - 1, 1.0), (p, p, None),
             (2 * p, 2 * p - 1, None)]
    return list(dict.fromkeys(rules))


@functools.lru_cache(maxsize=512)
def _zb_v_best(p: int, m: int, costs: tuple) -> tuple:
    best = None
    for w_first, f_first, slack in zb_v_variants(p):
        try:  # a variant whose ranks' remaining work passes the best makespan so far is dropped there (it cannot win)
            ops, makespan = _zb_v_tuples(p, m, costs, w_first, f_first, slack, bound=best[1] if best else float("inf"))
        except RuntimeError:  # a variant that stalls for these costs (none known) is skipped; the plain rule never does
            continue
        if ops is not None and (best is None or makespan < best[1] - 1e-9 * makespan):
            best = (ops, makespan)
    per_stage = zb_v_stage_costs(p, costs)
    if any(t != per_stage[0] for t in per_stage):
        # stages that differ: the orders for their mean triple compete too, timed at the stages' own costs (the list
        # rule is a heuristic: for a few cost sets its per-stage order is the longer one), so an order generated for
        # per-stage costs is never longer at those costs than the one for their mean
        mean = tuple(sum(t[k] for t in per_stage) / len(per_stage) for k in range(3))
        ops = _zb_v_best(p, m, mean)
        makespan = zb_v_makespan(p, _zb_v_ops(p, m, mean), costs)
        if makespan < best[1] - 1e-9 * makespan:
            best = (ops, makespan)
    return best[0]


@functools.lru_cache(maxsize=512)
def _zb_v_ops(p: int, m: int, costs: tuple) -> tuple:
    """``_zb_v_best``'s order as ``Op``s."""
    return tuple(tuple(Op(*op) for op in ops) for ops in _zb_v_best(p, m, costs))


def zb_v_makespan(p: int, order, costs: tuple) -> float:
    """The makespan of a ZB-V op list run at ``costs`` (``zb_v_stage_costs``), no communication time
    (:func:`timed_run` with each op charged its stage's cost) -- ``launcher.plan.simulator.simulate`` with
    placement zb_v."""
    per_stage = zb_v_stage_costs(p, costs)
    try:
        times = timed_run(order, Schedule.ZB_V, lambda k, op: per_stage[k]["FBW".index(op.kind)])
    except ValueError:
        raise RuntimeError(f"zb_v order deadlocks at p={p}") from None
    return max((end for ops in times for _, end in ops), default=0.0)


def timed_run(schedule, placement: str, cost) -> list:
    """(start, end) of every op of every rank when each rank runs its list in order, an op starting once its rank
    is free and its inputs exist (F after the previous stage's F, B/BW after the next stage's B/BW and its own F, W
    after its own B), each taking ``cost(stage, op)``; no communication time. Raises ValueError when the lists
    cannot all run (an op waits for one that never comes). What the p2p planner orders messages by
    (``launcher.core.pipeline.p2p``) and what :func:`zb_v_makespan` times."""
    p = len(schedule)
    chunks = 1 + max((op.chunk for ops in schedule for op in ops), default=0)
    last = p * chunks - 1
    end: dict = {}
    times: list = [[] for _ in range(p)]
    pos, clock, left = [0] * p, [0.0] * p, sum(len(ops) for ops in schedule)
    while left:
        moved = False
        for r in range(p):
            while pos[r] < len(schedule[r]):
                op = schedule[r][pos[r]]
                k, mb = stage_of(placement, p, r, op.chunk), op.microbatch
                if op.kind == "F":
                    deps = [("F", k - 1, mb)] if k > 0 else []
                elif op.kind in ("B", "BW"):
                    deps = [("F", k, mb)] + ([("B", k + 1, mb)] if k < last else [])
                else:
                    deps = [("B", k, mb)]
                if any(d not in end for d in deps):
                    break
                start = max([clock[r]] + [end[d] for d in deps])
                clock[r] = start + cost(k, op)
                end[("F" if op.kind == "F" else "B" if op.kind in ("B", "BW") else "W", k, mb)] = clock[r]
                times[r].append((start, clock[r]))
                pos[r] += 1
                left -= 1
                moved = True
        if not moved:
            raise ValueError(f"the op lists cannot run: ranks stop at "
                             f"{[ops[i] if i < len(ops) else None for ops, i in zip(schedule, pos)]}")
    return times


def zb_v_stage_costs(p: int, costs: tuple) -> tuple:
    """schedule.zb_v_costs as one (T_F, T_B, T_W) per pipeline stage 0..2p-1: three numbers apply to every stage,
    6p are one triple per stage in model order (stage s on rank s for s < p, else on rank 2p - 1 - s: rank 0's
    two chunks hold the embedding and the output layer + loss)."""
    costs = tuple(float(c) for c in costs)
    if len(costs) == 3:
        return (costs,) * (2 * p)
    if len(costs) != 6 * p:
        raise ValueError(f"zb_v costs: 3 or 6 x {p} numbers, got {len(costs)}")
    return tuple(costs[3 * s:3 * s + 3] for s in range(2 * p))


def _zb_v(p: int, m: int, costs: tuple, w_first: int, f_first: int, slack: float | None = None,
          bound: float = float("inf")) -> tuple:
    """``_zb_v_tuples``' order as ``Op``s, and its makespan."""
    ops, makespan = _zb_v_tuples(p, m, costs, w_first, f_first, slack, bound)
    return (None if ops is None else tuple(tuple(Op(*op) for op in rank) for rank in ops)), makespan


def _zb_v_tuples(p: int, m: int, costs: tuple, w_first: int, f_first: int, slack: float | None = None,
                 bound: float = float("inf")) -> tuple:
    """One list-scheduled ZB-V order and its makespan at ``costs`` (the times the list scheduler assigned: the same
    as ``launcher.plan.simulator.simulate`` replaying the order at those costs with no communication time);
    ``w_first``, ``f_first``, ``slack``: :func:`zb_v_variants`. ``(None, inf)`` once the clock passes ``bound``
    with ops left (the makespan would exceed it). The order is built as (kind, microbatch, chunk) tuples and made
    ``Op``s once, for the variant that wins (``_zb_v_best`` tries twelve: this loop is most of a search's time)."""
    limit, last, inf = 2 * p, 2 * p - 1, float("inf")
    per_stage = zb_v_stage_costs(p, costs)
    stage = [[stage_of(Schedule.ZB_V, p, r, c) for c in (0, 1)] for r in range(p)]
    # dur[r][c][kind]: rank r's chunk c runs stage stage[r][c]
    dur = [[dict(zip("FBW", per_stage[stage[r][c]])) for c in (0, 1)] for r in range(p)]
    f_end = [[inf] * m for _ in range(2 * p)]  # [stage][mb] -> end of its F
    b_end = [[inf] * m for _ in range(2 * p)]  # [stage][mb] -> end of its B
    end = {"F": f_end, "B": b_end}
    # when a B of rank r's chunk c has its inputs, by microbatch: the next stage's B end (the last stage: its own F)
    b_src = [[f_end[k] if k == last else b_end[k + 1] for k in stage[r]] for r in range(p)]
    f_src = [[f_end[k - 1] if k > 0 else None for k in stage[r]] for r in range(p)]  # an F's input: previous F
    out: list[list[tuple]] = [[] for _ in range(p)]
    free = [0.0] * p
    held = [0] * p  # chunk-microbatches between F and W
    next_f = [[0, 0] for _ in range(p)]  # next microbatch to forward, per chunk
    pending_b: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # (microbatch, chunk) forwarded, no B yet
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    total, count, t = 3 * 2 * m * p, 0, 0.0
    left = [m * sum(sum(d.values()) for d in dur[r]) for r in range(p)]  # compute each rank has still to place
    events: list = []  # end times of the ops run so far (min-heap)
    heappush = heapq.heappush

    def forward(r: int, take: bool = True) -> tuple | None:
        nf, src = next_f[r], f_src[r]
        for c in (1, 0):
            mb = nf[c]
            # a chunk-0 F leaves one slot free for a chunk-1 F: the V then always drains (one microbatch at a time
            # through chunk 1, each W freeing its slot) and the list never gets stuck
            if mb < m and held[r] < limit - (1 - c) and (src[c] is None or src[c][mb] <= t):
                if take:
                    nf[c] += 1
                    held[r] += 1
                    pending_b[r].append((mb, c))
                return ("F", mb, c)
        return None

    def filler(r: int) -> str | None:
        """F or W for a rank with no B ready (None: wait for the next event)."""
        f = None if pending_w[r] and held[r] >= w_first else forward(r, take=False)
        fill = ([("F", dur[r][f[2]]["F"])] if f else []) + \
            ([("W", dur[r][pending_w[r][0][1]]["W"])] if pending_w[r] else [])  # (kind, its duration)
        if slack is None or not fill:
            return fill[0][0] if fill else None
        src = b_src[r]
        gap = min((src[c][mb] for mb, c in pending_b[r]), default=inf) - t
        fits = [k for k, d in fill if d <= gap * (1 + 1e-12)]
        if fits:
            return fits[0]
        # the B arrives soon (its upstream op is placed: an event the clock reaches): idle until then
        return None if gap < slack * min(d for _, d in fill) else fill[0][0]

    while count < total:
        for r in range(p):
            if free[r] > t:
                continue
            choice = forward(r) if held[r] < f_first else None
            b = None
            if choice is None:  # the ready B of the oldest microbatch, the chunk nearer the loss (chunk 1) first
                src = b_src[r]
                for mb, c in pending_b[r]:
                    if src[c][mb] <= t and (b is None or mb < b[0] or (mb == b[0] and c > b[1])):
                        b = (mb, c)
            if b is not None:
                mb, c = b
                choice = ("B", mb, c)
                pending_b[r].remove(b)
                pending_w[r].append(b)
            elif choice is None:
                kind = filler(r)
                if kind == "F":
                    choice = forward(r)
                elif kind == "W":
                    mb, c = pending_w[r].pop(0)
                    choice = ("W", mb, c)
                    held[r] -= 1
            if choice is not None:
                kind, mb, c = choice
                out[r].append(choice)
                d = dur[r][c][kind]
                left[r] -= d
                free[r] = t + d
                if kind != "W":
                    end[kind][stage[r][c]][mb] = free[r]
                heappush(events, free[r])
                count += 1
        t = _next_event(events, t, count < total, f"zb_v, p={p}, m={m}")
        # each rank still has its own ops to run after t: past the bound, this variant cannot win
        # (max over ranks of max(free, t) + left = the larger of max(free + left) and t + max(left))
        if count < total and bound < inf and max(max(map(add, free, left)), t + max(left)) >= bound * (1 - 1e-9):
            return None, inf
    return tuple(tuple(ops) for ops in out), max(free)


def build_schedule(kind: str, p: int, m: int, v: int = 1, group: int | None = None,
                   costs: tuple = (1.0, 1.0, 1.0)) -> list[list[Op]]:
    """The per-rank op lists for schedule ``kind`` (1f1b, interleaved, zb_h1 (over v chunks when v > 1), zb_v;
    ``costs``: zb_v's (T_F, T_B, T_W) per chunk, relative)."""
    if kind == Schedule.INTERLEAVED and v > 1:
        return schedule_interleaved(p, m, v, group)
    if kind == Schedule.ZB_H1:
        return schedule_zb_h1(p, m, v, group)
    if kind == Schedule.ZB_V:
        return schedule_zb_v(p, m, costs)
    return schedule_1f1b(p, m)
