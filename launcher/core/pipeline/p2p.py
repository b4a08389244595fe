"""Pipeline p2p programs, torch-free: which sends and receives a rank posts, grouped how, waited where; and a
replay of any set of such programs under NCCL's rules.

Why this exists: gloo buffers every send, NCCL does not. Under NCCL a send of more than its per-peer buffer (any
real activation) completes only together with the peer's matching receive; p2p ops between two ranks run in
order on one communicator and stream (PyTorch keys a p2p communicator by the rank pair, and Megatron-Core puts
both directions of a stage pair on the pipeline group for PP > 2); ops posted as one group
(``batch_isend_irecv`` = ``ncclGroupStart/End``) progress together. Two stages that each post "send, then
receive" to each other deadlock. And under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron's setting for TP/CP
communication overlap before Blackwell) a GPU runs every kernel, whatever its stream, on one hardware queue in
launch order: a p2p op that cannot complete yet holds up everything the rank launched after it. A schedule that
runs on gloo can therefore hang on the first GPU cluster; the replay below finds that on CPU, under either rule.

``plan`` turns one rank's op list (``launcher.core.pipeline.schedules``) into its p2p program; the rank wing's zero-bubble
executor (``launcher/rank/zb_executor.py``) executes exactly that program. Over one chunk the rule mirrors Megatron-Core's
1F1B, which fuses a send with the receive that follows it from the same peer (``send_forward_recv_backward``,
``send_backward_recv_forward``): here a send is posted in one group with the next receive from the same peer
when that receive is the next p2p op on that pair, so neither side ever waits on a lone send whose peer is
itself waiting on a lone send. Unlike Megatron's blocking fused call, the group is waited only right before
the op that needs the received tensor, so W passes run while it is in flight. Over several chunks a rank pair
carries messages both ways, and every rank posts in one global order of the messages instead
(``_plan_in_time_order``).

A program is a list of events (JSON-able tuples, also what tests record from real ranks):

* ``("post", item, ops, stream)``: a group of p2p ops posted together; each op ``(kind, peer, channel, tag)``
  with kind ``send``/``recv``, ``peer`` the other rank, ``channel`` the communicator (process group) it uses,
  and ``tag`` what it carries (e.g. ``act3`` / ``grad3``, or a tensor size) to check that matched ops agree;
  ``stream`` is ``group`` for a ``batch_isend_irecv`` (PyTorch runs a coalesced batch on the process group's
  communicator, one stream for all peers) or ``pair`` for a single ``isend``/``irecv`` (the rank pair's own
  communicator);
* ``("wait", item)``: the rank blocks until that group has completed;
* ``("coll", channel, ranks)``: a collective over ``ranks`` on ``channel`` (a barrier for the replay).
"""
from __future__ import annotations

from collections import defaultdict, deque
from typing import Dict, List, Optional, Sequence, Tuple

from launcher.core.pipeline.schedules import Op, place, stage_of, timed_run
from launcher.schema import Schedule

Event = tuple
UP = "_up"
"""Suffix of the second pipeline channel (messages to the lower rank) of two-chunk programs (ZB-V)."""


# ------------------------------------------------------------------------------------------- planning
def _neighbours(r: int, p: int, op: Op, placement: str = Schedule.ONE_F_ONE_B, chunks: int = 1) -> Tuple[list, list]:
    """(receives before, sends after) of one op on rank r of p, as (kind, peer, tag): F receives the activation
    from the previous pipeline stage and sends its output to the next; B/BW receive the output gradient from the
    next stage and send the input gradient to the previous (none at the pipeline's ends, nor between two chunks
    of one rank: ZB-V's turn on the last rank is a local hand-over). Stages per ``schedules.stage_of``; with
    several chunks a tag names the receiving chunk (``act3c1``), else just the microbatch (``act3``)."""
    stages = p * chunks
    k = stage_of(placement, p, r, op.chunk)

    def tag(base: str, stage: int) -> str:
        return f"{base}{op.microbatch}" + (f"c{place(placement, p, stage)[1]}" if chunks > 1 else "")

    def peer(stage: int) -> list:
        rank = place(placement, p, stage)[0]
        return [] if rank == r else [rank]

    if op.kind == "F":
        return ([("recv", q, tag("act", k)) for q in peer(k - 1)] if k > 0 else [],
                [("send", q, tag("act", k + 1)) for q in peer(k + 1)] if k < stages - 1 else [])
    if op.kind in ("B", "BW"):
        return ([("recv", q, tag("grad", k)) for q in peer(k + 1)] if k < stages - 1 else [],
                [("send", q, tag("grad", k - 1)) for q in peer(k - 1)] if k > 0 else [])
    return [], []  # W: no communication


def plan(ops: Sequence[Op], r: int, p: int, channel: str = "pp", placement: str = Schedule.ONE_F_ONE_B,
         schedule: Optional[Sequence[Sequence[Op]]] = None, overlap: bool = False) -> List[Event]:
    """The p2p program of rank ``r`` of ``p`` running ``ops``: ``("op", Op)`` compute events interleaved with
    posts and waits. Item ids are ``(r, n)``. ``placement``: ``schedules.stage_of``'s kind (``zb_v`` for the V;
    the default places chunk c of rank r at stage c * p + r); ``schedule``: every rank's op list.

    One chunk per rank (1F1B, ZB-H1): every receive is waited right before the op that consumes it; a send is
    posted right after the op that produced it, in one group with the next receive from the same peer if that is
    the pair's next p2p op (else alone, waited at the end of the step): Megatron's fused
    ``send_forward_recv_backward``. Each rank pair carries activations one way and gradients the other, each rank
    has at most one send in flight per direction, and the program completes under one hardware queue per GPU.

    Several chunks per rank (ZB-V, ZB-H1 over a virtual pipeline): :func:`_plan_in_time_order`."""
    chunks = 1 + max((op.chunk for op in ops), default=0)
    if chunks > 1:
        if schedule is None:
            raise ValueError(f"rank {r}: a program over {chunks} chunks needs every rank's op list (schedule=)")
        return _plan_in_time_order(r, p, channel, placement, schedule, overlap, _messages_in_time(schedule, placement))
    needs: list = []  # (index of the op it belongs to, before?, kind, peer, tag) in op order
    for i, op in enumerate(ops):
        before, after = _neighbours(r, p, op, placement, chunks)
        needs += [(i, True, *c) for c in before] + [(i, False, *c) for c in after]
    fused_recv: Dict[int, tuple] = {}  # position in needs of a receive already posted with a send -> item
    posts_after: Dict[int, list] = defaultdict(list)  # op index -> events right after it
    posts_before: Dict[int, list] = defaultdict(list)  # op index -> events right before it
    lone_sends: list = []
    sent: Dict[tuple, tuple] = {}  # (microbatch, chunk) of an F -> the group that sent its output
    n = 0
    for j, (i, before, kind, peer, tag) in enumerate(needs):
        if kind == "send":
            item, n = (r, n), n + 1
            nxt = next((k for k in range(j + 1, len(needs)) if needs[k][3] == peer), None)
            group = [("send", peer, channel, tag)]
            if nxt is not None and needs[nxt][2] == "recv":
                group.append(("recv", peer, channel, needs[nxt][4]))
                fused_recv[nxt] = item
            else:
                lone_sends.append(item)
            posts_after[i].append(("post", item, group, "group"))
            if ops[i].kind == "F":
                sent[(ops[i].microbatch, ops[i].chunk)] = item
        elif j in fused_recv:
            posts_before[i].append(("wait", fused_recv[j]))
        else:
            item, n = (r, n), n + 1
            posts_before[i] += [("post", item, [("recv", peer, channel, tag)], "group"), ("wait", item)]
    return _assemble(ops, posts_before, posts_after, sent, lone_sends)


def _assemble(ops: Sequence[Op], posts_before: dict, posts_after: dict, sent: dict, lone_sends: list) -> List[Event]:
    """The program: each op with the events placed before and after it, one wait per group, and the sends never
    waited before the end waited there. A backward frees its forward's output (Megatron's
    deallocate_output_tensor), so the group that sent that output must have completed: it is waited right before
    the backward (always already true under NCCL, where the output gradient can only come back after the
    activation arrived; the wait makes it explicit)."""
    waited: set = set()
    posted: set = set()
    program: List[Event] = []
    for i, op in enumerate(ops):
        item = sent.get((op.microbatch, op.chunk)) if op.kind in ("B", "BW") else None
        evs = posts_before[i]
        if item is not None:  # waited first, or after its own post where that comes right before the backward
            evs = [("wait", item)] + evs if item in posted else evs + [("wait", item)]
        for ev in evs:
            if ev[0] == "post":
                posted.add(ev[1])
            if ev[0] == "wait" and ev[1] in waited:
                continue  # one wait per group
            if ev[0] == "wait":
                waited.add(ev[1])
            program.append(ev)
        program += [("op", op)] + posts_after[i]
        posted.update(ev[1] for ev in posts_after[i])
    program += posts_before[len(ops)]
    return program + [("wait", item) for item in lone_sends if item not in waited]


_COST = {"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0}
"""Relative op costs of the timed run :func:`_plan_in_time_order` orders messages by (any positive costs give a
deadlock-free program; these are the schedules' own equal-cost setting)."""


def _executed_times(schedule: Sequence[Sequence[Op]], placement: str) -> List[List[Tuple[float, float]]]:
    """(start, end) of every op of every rank in one timed run at :data:`_COST` (``schedules.timed_run``)."""
    return timed_run(schedule, placement, lambda stage, op: _COST[op.kind])


def _messages_in_time(schedule: Sequence[Sequence[Op]], placement: str) -> tuple:
    """(every rank's (start, end) per op, every message as (time, sender, receiver, tag, index of the op producing
    it on the sender) in the global order) of one timed run (:func:`_executed_times`)."""
    p = len(schedule)
    chunks = 1 + max((op.chunk for ops in schedule for op in ops), default=0)
    times = _executed_times(schedule, placement)
    messages = [(times[q][i][1], q, peer, tag, i) for q, q_ops in enumerate(schedule) for i, op in enumerate(q_ops)
                for _, peer, tag in _neighbours(q, p, op, placement, chunks)[1]]
    return times, sorted(messages)


def _plan_in_time_order(r: int, p: int, channel: str, placement: str, schedule: Sequence[Sequence[Op]],
                        overlap: bool, timed: tuple) -> List[Event]:
    """The program of rank ``r`` when chunks make a rank pair carry messages both ways (ZB-V's V; the wrap from
    stage p - 1 to rank 0 of the interleaved placement).

    Under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` a GPU runs every kernel it is given in launch order on one hardware
    queue, so a p2p op that cannot complete (a send whose receive is not yet posted, or the reverse) holds up every
    later kernel of that GPU, whatever its stream or communicator (NCCL does not promise that two communicators
    progress independently: NVIDIA/nccl#783). A program is then safe only if there is one global order of the
    messages in which every rank posts its own: whichever message is first among those not yet complete is at the
    head of both its ranks' queues and completes. That order is taken from one timed run of the op lists
    (:func:`_executed_times`): a message exists when the op producing it ends, and every message is ordered by
    that time (ties by sender, receiver, tag, the same on both sides). Each rank posts its sends and receives in
    that order, each a single ``isend``/``irecv`` (PyTorch gives each rank pair of a process group its own
    communicator) on one of two process groups, ``channel`` for messages to the higher rank and ``channel + UP``
    for messages to the lower one. So at most one p2p op of a rank is ever in flight ahead of the others, a pair's
    sends match its receives in order (NCCL has no tags), and the order holds on a GPU with any number of queues.

    Where in the op list each is posted: a send right after the op producing it (or later, behind the one before
    it in the order); a receive, with ``overlap`` (schedule.overlap_p2p_comm), as soon as the order lets it (the
    transfer then runs under the ops before the consumer, as Megatron's interleaved schedule posts the next
    receive early), else right before the op consuming it unless a later message of the order must be posted
    earlier. Each receive is waited right before the op consuming it."""
    ops = schedule[r]
    chunks = 1 + max((op.chunk for o in schedule for op in o), default=0)
    times, messages = timed  # _messages_in_time
    consumer: Dict[tuple, int] = {}  # (sender, tag) -> index of the op consuming it on this rank
    for i, op in enumerate(ops):
        consumer.update({(peer, tag): i for _, peer, tag in _neighbours(r, p, op, placement, chunks)[0]})
    mine = [m for m in messages if r in (m[1], m[2])]
    if {(m[1], m[3]) for m in mine if m[2] == r} != set(consumer):
        raise ValueError(f"rank {r}: the messages it receives are not the ones its ops consume")
    starts = [t[0] for t in times[r]]
    at = [sum(1 for s in starts if s < m[0]) for m in mine]  # ops started before the message exists
    if not overlap:  # receives as late as their consumer and the order allow (backwards: monotone positions)
        later = len(ops)
        for j in range(len(mine) - 1, -1, -1):
            if mine[j][2] == r:
                at[j] = min(consumer[(mine[j][1], mine[j][3])], later)
            later = at[j]
    posts_before: Dict[int, list] = defaultdict(list)
    sent: Dict[tuple, tuple] = {}
    lone_sends: list = []
    waits: Dict[int, list] = defaultdict(list)
    for n, ((_, src, dst, tag, i), pos) in enumerate(zip(mine, at)):
        item, peer = (r, n), dst if src == r else src
        ch = channel if src < dst else channel + UP
        kind = "send" if src == r else "recv"
        posts_before[pos].append(("post", item, [(kind, peer, ch, tag)], "pair"))
        if kind == "send":
            lone_sends.append(item)
            if ops[i].kind == "F":
                sent[(ops[i].microbatch, ops[i].chunk)] = item
        else:
            waits[consumer[(src, tag)]].append(("wait", item))
    for i, evs in waits.items():
        posts_before[i] += evs  # after every post placed before op i: the consumer's receive is one of them
    return _assemble(ops, posts_before, defaultdict(list), sent, lone_sends)


def plan_all(schedule: Sequence[Sequence[Op]], channel: str = "pp",
             placement: str = Schedule.ONE_F_ONE_B, overlap: bool = False) -> List[List[Event]]:
    """``plan`` for every rank of a schedule (``launcher.core.pipeline.schedules.build_schedule``)."""
    p = len(schedule)
    if any(op.chunk for ops in schedule for op in ops):  # the timed run once for every rank
        timed = _messages_in_time(schedule, placement)
        return [_plan_in_time_order(r, p, channel, placement, schedule, overlap, timed) for r in range(p)]
    return [plan(ops, r, p, channel, placement, schedule, overlap) for r, ops in enumerate(schedule)]


# ------------------------------------------------------------------------------------------- replay
class Deadlock(RuntimeError):
    """The programs cannot all finish under NCCL's rules; the message says which rank waits on what."""


def replay(programs: Sequence[Sequence[Event]], connections: Optional[int] = None) -> int:
    """Run every rank's program under NCCL's p2p rules; returns the number of p2p ops matched.

    Rules: posting never blocks; a rank blocks at ``wait`` until the group completed and at ``coll`` until every
    rank of the collective arrived (k-th collective of that channel on each). On every rank, the groups that use
    a given (channel, rank pair) run in post order: a group starts once every earlier group on each of its pairs
    has completed. A send completes only together with its matching receive (the k-th send from a to b on a
    channel matches b's k-th receive from a), when both have started; no send completes into a buffer alone.
    A group completes when all of its ops have. Raises :class:`Deadlock` when no rank can move, or ``ValueError``
    when matched ops carry different tags (wrong data would arrive).

    ``connections=1`` (``CUDA_DEVICE_MAX_CONNECTIONS=1``) adds the GPU's one hardware work queue: every kernel a
    rank launches, whatever its stream or communicator, runs in launch order, so a group starts only once every
    group the rank posted before it has completed, and a collective starts only once the rank's queue is empty.
    Otherwise (None, or several connections: CUDA maps streams onto them round-robin, so which streams share a
    queue is not the program's to choose) the queues are per communicator as above. A program that completes
    under one queue completes under any other mapping: more queues only let more groups start."""
    ranks = range(len(programs))
    one_queue = connections == 1
    items: Dict[tuple, dict] = {}
    queues: Dict[tuple, deque] = defaultdict(deque)  # (rank, channel, pair) -> item ids in post order
    sends: Dict[tuple, list] = defaultdict(list)  # (channel, src, dst) -> [(item, op index)]
    recvs: Dict[tuple, list] = defaultdict(list)
    pc = [0] * len(programs)
    coll_arrived: Dict[tuple, set] = defaultdict(set)  # (channel, ranks, k) -> ranks arrived
    coll_count: Dict[tuple, int] = defaultdict(int)  # (rank, channel, ranks) -> collectives passed
    matched = 0

    def started(item) -> bool:
        it = items[item]
        return all(queues[q][0] == item for q in it["queues"])

    def post(r: int, item, ops, stream: str) -> None:
        # a batched group runs on the process group's own communicator (one stream for every peer: PyTorch's
        # ProcessGroupNCCL keys a coalesced p2p batch by device); a single isend/irecv on the rank pair's
        qs = [(r, "gpu", "*")] if one_queue else \
            sorted({(r, ch, "*" if stream == "group" else tuple(sorted((r, peer)))) for _, peer, ch, _ in ops})
        items[item] = {"rank": r, "ops": list(ops), "done": [False] * len(ops), "queues": qs, "complete": False}
        open_items.add(item)
        for q in qs:
            queues[q].append(item)
        for k, (kind, peer, ch, _) in enumerate(ops):
            (sends[(ch, r, peer)] if kind == "send" else recvs[(ch, peer, r)]).append((item, k))

    first: Dict[tuple, int] = defaultdict(int)  # (channel, src, dst) -> its first send not yet matched
    open_items: set = set()  # posted, not complete

    def complete_pairs() -> int:
        count = 0
        for key, sent in sends.items():
            got = recvs.get(key, [])
            while first[key] < len(sent) and items[sent[first[key]][0]]["done"][sent[first[key]][1]]:
                first[key] += 1
            for (si, sk), (ri, rk) in zip(sent[first[key]:], got[first[key]:]):
                if items[si]["done"][sk] or not (started(si) and started(ri)):
                    continue
                st, rt = items[si]["ops"][sk][3], items[ri]["ops"][rk][3]
                if st != rt:
                    raise ValueError(f"rank {key[1]} sends {st} on {key[0]} where rank {key[2]} receives {rt}")
                items[si]["done"][sk] = items[ri]["done"][rk] = True
                count += 1
        for item in sorted(i for i in open_items if all(items[i]["done"])):
            it = items[item]
            open_items.discard(item)
            it["complete"] = True
            for q in it["queues"]:
                assert queues[q][0] == item
                queues[q].popleft()
        return count

    while True:
        moved = False
        for r in ranks:
            prog = programs[r]
            while pc[r] < len(prog):
                ev = prog[pc[r]]
                if ev[0] == "post":
                    post(r, ev[1] if not isinstance(ev[1], list) else tuple(ev[1]), ev[2],
                         ev[3] if len(ev) > 3 else "pair")
                elif ev[0] == "wait":
                    item = ev[1] if not isinstance(ev[1], list) else tuple(ev[1])
                    if not items[item]["complete"]:
                        break
                elif ev[0] == "op":
                    pass  # compute: never blocks on another rank by itself
                elif ev[0] == "coll":
                    if one_queue and queues[(r, "gpu", "*")]:
                        break  # the collective's kernel queues behind the rank's p2p groups still in flight
                    ch, members = ev[1], tuple(ev[2])
                    k = coll_count[(r, ch, members)]
                    arrived = coll_arrived[(ch, members, k)]
                    arrived.add(r)
                    if len(arrived) < len(members):
                        break
                    coll_count[(r, ch, members)] += 1
                pc[r] += 1
                moved = True
        new = complete_pairs()
        matched += new
        if all(pc[r] == len(programs[r]) for r in ranks):
            pending = [i for i, it in items.items() if not it["complete"]]
            if pending:
                raise Deadlock(f"every program ended with {len(pending)} p2p groups never completed, e.g. "
                               f"{pending[0]}: {items[pending[0]]['ops']}")
            return matched
        if not moved and not new:
            stuck = [(r, programs[r][pc[r]]) for r in ranks if pc[r] < len(programs[r])]
            details = "; ".join(f"rank {r} at {_describe(ev, items)}" for r, ev in stuck[:4])
            raise Deadlock(f"{len(stuck)} ranks can never move: {details}")


def _describe(ev: Event, items: dict) -> str:
    if ev[0] == "wait":
        item = ev[1] if not isinstance(ev[1], list) else tuple(ev[1])
        return f"wait for {items[item]['ops']}"
    return f"{ev[0]} {ev[1:]}"
