"""Pipeline p2p programs, torch-free: which sends and receives a rank posts, grouped how, waited where; and a
replay of any set of such programs under NCCL's rules.

Why this exists: gloo buffers every send, NCCL does not. Under NCCL a send of more than its per-peer buffer (any
real activation) completes only together with the peer's matching receive; p2p ops between two ranks run in
order on one communicator and stream (PyTorch keys a p2p communicator by the rank pair, and Megatron-Core puts
both directions of a stage pair on the pipeline group for PP > 2); ops posted as one group
(``batch_isend_irecv`` = ``ncclGroupStart/End``) progress together. Two stages that each post "send, then
receive" to each other deadlock. A schedule that runs on gloo can therefore hang on the first GPU cluster; the
replay below finds that on CPU.

``plan`` turns one rank's op list (``launcher.core.schedules``) into its p2p program; the rank wing's ZB-H1
executor (``launcher/rank/zero_bubble.py``) executes exactly that program. The rule mirrors Megatron-Core's
1F1B, which fuses a send with the receive that follows it from the same peer (``send_forward_recv_backward``,
``send_backward_recv_forward``): here a send is posted in one group with the next receive from the same peer
when that receive is the next p2p op on that pair, so neither side ever waits on a lone send whose peer is
itself waiting on a lone send. Unlike Megatron's blocking fused call, the group is waited only right before
the op that needs the received tensor, so W passes run while it is in flight.

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

from launcher.core.schedules import Op, place, stage_of
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
    posts and waits. Item ids are ``(r, n)``. Every receive is waited right before the op that consumes it; a send
    is posted right after the op that produced it, in one group with the next receive from the same peer if that
    is the pair's next p2p op (else alone, waited at the end of the step). ``placement``: ``schedules.stage_of``'s
    kind (``zb_v`` for the V; the default places chunk c of rank r at stage c * p + r).

    With two chunks per rank (ZB-V) both directions of a rank pair carry activations and gradients, so a send
    fused with a receive could tie two unrelated waits into a cycle, and a lone send blocks whatever follows it on
    its communicator. There every op is a single ``isend``/``irecv`` (PyTorch gives each rank pair of a process
    group its own communicator) on one of two process groups: ``channel`` for messages to the higher rank,
    ``channel + UP`` for messages to the lower one; so each communicator carries one direction only and a send
    waits for nothing but its own receive. Receives are posted and waited right before the op that needs them;
    with ``overlap`` (schedule.overlap_p2p_comm, as Megatron's interleaved schedule posts the next receive before
    the current op's compute) each is posted one op earlier, so the transfer runs under that op. The pair's
    communicator carries that one direction only, in the order both sides agree on, so an early receive delays
    nothing but itself.

    Sends to one peer are posted in the order that peer receives (NCCL matches a pair's p2p ops in order, it
    has no tags; and posting a receive long before it is needed would hold up every later group on the rank's
    stream). In 1F1B and ZB-H1 that is the order they are produced in; in ZB-V a rank sends its neighbour both
    chunk-0 activations and chunk-1 gradients, which the neighbour may need the other way round: a send is then
    held back until the ones the peer needs first have been posted (``schedule``, every rank's op list, gives the
    peers' order; without it, the production order is taken to be the need order)."""
    chunks = 1 + max((op.chunk for op in ops), default=0)
    needs: list = []  # (index of the op it belongs to, before?, kind, peer, tag) in op order
    for i, op in enumerate(ops):
        before, after = _neighbours(r, p, op, placement, chunks)
        needs += [(i, True, *c) for c in before] + [(i, False, *c) for c in after]
    order: Dict[int, list] = {}  # peer -> the tags it receives from r, in its op order
    for q in {c[3] for c in needs if c[2] == "send"}:
        if schedule is None:
            order[q] = [c[4] for c in needs if c[2] == "send" and c[3] == q]
        else:
            order[q] = [tag for op in schedule[q] for kind, peer, tag in _neighbours(q, p, op, placement, chunks)[0]
                        if peer == r]
    produced: Dict[int, set] = defaultdict(set)
    next_send: Dict[int, int] = defaultdict(int)
    producer: Dict[str, int] = {}
    comm: list = []  # the same, each send moved to where the peer's order lets it go
    for i, before, kind, peer, tag in needs:
        if kind == "recv":
            comm.append((i, before, kind, peer, tag))
            continue
        produced[peer].add(tag)
        producer[tag] = i
        while next_send[peer] < len(order[peer]) and order[peer][next_send[peer]] in produced[peer]:
            comm.append((i, False, "send", peer, order[peer][next_send[peer]]))
            next_send[peer] += 1
    if any(next_send[q] < len(order[q]) for q in order):
        raise ValueError(f"rank {r}: sends never produced for {[order[q][next_send[q]:] for q in order]}")
    fused_recv: Dict[int, tuple] = {}  # position in comm of a receive already posted with a send -> item
    posts_after: Dict[int, list] = defaultdict(list)  # op index -> events right after it
    posts_before: Dict[int, list] = defaultdict(list)  # op index -> events right before it
    lone_sends: list = []
    sent: Dict[tuple, tuple] = {}  # (microbatch, chunk) of an F -> the group that sent its output
    n = 0
    for j, (i, before, kind, peer, tag) in enumerate(comm):
        if chunks > 1:  # ZB-V: one channel per direction, single ops (see above)
            item, n = (r, n), n + 1
            lower, higher = (r, peer) if kind == "send" else (peer, r)
            ch = channel if lower < higher else channel + UP
            if kind == "send":
                posts_after[i].append(("post", item, [("send", peer, ch, tag)], "pair"))
                lone_sends.append(item)
                src = ops[producer[tag]]
                if src.kind == "F":
                    sent[(src.microbatch, src.chunk)] = item
            elif overlap and i > 0:  # posted before the previous op (after that op's own receives), waited here
                posts_before[i - 1].append(("post", item, [("recv", peer, ch, tag)], "pair"))
                posts_before[i].append(("wait", item))
            else:
                posts_before[i] += [("post", item, [("recv", peer, ch, tag)], "pair"), ("wait", item)]
            continue
        if kind == "send":
            item, n = (r, n), n + 1
            nxt = next((k for k in range(j + 1, len(comm)) if comm[k][3] == peer), None)
            group = [("send", peer, channel, tag)]
            if nxt is not None and comm[nxt][2] == "recv":
                group.append(("recv", peer, channel, comm[nxt][4]))
                fused_recv[nxt] = item
            else:
                lone_sends.append(item)
            posts_after[i].append(("post", item, group, "group"))
            src = ops[producer[tag]]
            if src.kind == "F":
                sent[(src.microbatch, src.chunk)] = item
        elif j in fused_recv:
            posts_before[i].append(("wait", fused_recv[j]))
        else:
            item, n = (r, n), n + 1
            posts_before[i] += [("post", item, [("recv", peer, channel, tag)], "group"), ("wait", item)]
    # A backward frees its forward's output (Megatron's deallocate_output_tensor), so the group that sent that
    # output must have completed: wait it right before the backward (always already true under NCCL, where the
    # output gradient can only come back after the activation arrived; the wait makes it explicit).
    waited: set = set()
    program: List[Event] = []
    for i, op in enumerate(ops):
        item = sent.get((op.microbatch, op.chunk)) if op.kind in ("B", "BW") else None
        for ev in ([("wait", item)] if item is not None else []) + posts_before[i]:
            if ev[0] == "wait" and ev[1] in waited:
                continue  # one wait per group
            if ev[0] == "wait":
                waited.add(ev[1])
            program.append(ev)
        program += [("op", op)] + posts_after[i]
    return program + [("wait", item) for item in lone_sends if item not in waited]


def plan_all(schedule: Sequence[Sequence[Op]], channel: str = "pp",
             placement: str = Schedule.ONE_F_ONE_B, overlap: bool = False) -> List[List[Event]]:
    """``plan`` for every rank of a schedule (``launcher.core.schedules.build_schedule``)."""
    p = len(schedule)
    return [plan(ops, r, p, channel, placement, schedule, overlap) for r, ops in enumerate(schedule)]


# ------------------------------------------------------------------------------------------- replay
class Deadlock(RuntimeError):
    """The programs cannot all finish under NCCL's rules; the message says which rank waits on what."""


def replay(programs: Sequence[Sequence[Event]]) -> int:
    """Run every rank's program under NCCL's p2p rules; returns the number of p2p ops matched.

    Rules: posting never blocks; a rank blocks at ``wait`` until the group completed and at ``coll`` until every
    rank of the collective arrived (k-th collective of that channel on each). On every rank, the groups that use
    a given (channel, rank pair) run in post order: a group starts once every earlier group on each of its pairs
    has completed. A send completes only together with its matching receive (the k-th send from a to b on a
    channel matches b's k-th receive from a), when both have started; no send completes into a buffer alone.
    A group completes when all of its ops have. Raises :class:`Deadlock` when no rank can move, or ``ValueError``
    when matched ops carry different tags (wrong data would arrive)."""
    ranks = range(len(programs))
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
        qs = sorted({(r, ch, "*" if stream == "group" else tuple(sorted((r, peer)))) for _, peer, ch, _ in ops})
        items[item] = {"rank": r, "ops": list(ops), "done": [False] * len(ops), "queues": qs, "complete": False}
        for q in qs:
            queues[q].append(item)
        for k, (kind, peer, ch, _) in enumerate(ops):
            (sends[(ch, r, peer)] if kind == "send" else recvs[(ch, peer, r)]).append((item, k))

    def complete_pairs() -> int:
        count = 0
        for key, sent in sends.items():
            got = recvs.get(key, [])
            for (si, sk), (ri, rk) in zip(sent, got):
                if items[si]["done"][sk] or not (started(si) and started(ri)):
                    continue
                st, rt = items[si]["ops"][sk][3], items[ri]["ops"][rk][3]
                if st != rt:
                    raise ValueError(f"rank {key[1]} sends {st} on {key[0]} where rank {key[2]} receives {rt}")
                items[si]["done"][sk] = items[ri]["done"][rk] = True
                count += 1
        for item, it in items.items():
            if not it["complete"] and all(it["done"]):
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
