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
from typing import Dict, List, Sequence, Tuple

from launcher.core.schedules import Op

Event = tuple


# ------------------------------------------------------------------------------------------- planning
def _neighbours(r: int, p: int, op: Op) -> Tuple[list, list]:
    """(receives before, sends after) of one op on rank r of p, as (kind, peer, tag): F receives the activation
    from r-1 and sends its output to r+1; B/BW receive the output gradient from r+1 and send the input gradient
    to r-1 (none at the pipeline's ends)."""
    if op.kind == "F":
        return ([("recv", r - 1, f"act{op.microbatch}")] if r > 0 else [],
                [("send", r + 1, f"act{op.microbatch}")] if r < p - 1 else [])
    if op.kind in ("B", "BW"):
        return ([("recv", r + 1, f"grad{op.microbatch}")] if r < p - 1 else [],
                [("send", r - 1, f"grad{op.microbatch}")] if r > 0 else [])
    return [], []  # W: no communication


def plan(ops: Sequence[Op], r: int, p: int, channel: str = "pp") -> List[Event]:
    """The p2p program of rank ``r`` of ``p`` running ``ops``: ``("op", Op)`` compute events interleaved with
    posts and waits. Item ids are ``(r, n)``. Every receive is waited right before the op that consumes it; a send
    is posted right after the op that produced it, in one group with the next receive from the same peer if that
    is the pair's next p2p op (else alone, waited at the end of the step)."""
    comm: list = []  # (index of the op it belongs to, before?, kind, peer, tag) in program order
    for i, op in enumerate(ops):
        before, after = _neighbours(r, p, op)
        comm += [(i, True, *c) for c in before] + [(i, False, *c) for c in after]
    fused_recv: Dict[int, tuple] = {}  # position in comm of a receive already posted with a send -> item
    posts_after: Dict[int, list] = defaultdict(list)  # op index -> events right after it
    posts_before: Dict[int, list] = defaultdict(list)  # op index -> events right before it
    lone_sends: list = []
    n = 0
    for j, (i, before, kind, peer, tag) in enumerate(comm):
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
        elif j in fused_recv:
            posts_before[i].append(("wait", fused_recv[j]))
        else:
            item, n = (r, n), n + 1
            posts_before[i] += [("post", item, [("recv", peer, channel, tag)], "group"), ("wait", item)]
    # A backward frees its forward's output (Megatron's deallocate_output_tensor), so the group that sent that
    # output must have completed: wait it right before the backward (always already true under NCCL, where the
    # output gradient can only come back after the activation arrived; the wait makes it explicit).
    sent = {tag: item for i in posts_after for ev in posts_after[i] for kind, _, _, tag in ev[2] if kind == "send"
            for item in [ev[1]]}
    waited: set = set()
    program: List[Event] = []
    for i, op in enumerate(ops):
        item = sent.get(f"act{op.microbatch}") if op.kind in ("B", "BW") else None
        for ev in ([("wait", item)] if item is not None else []) + posts_before[i]:
            if ev[0] == "wait" and ev[1] in waited:
                continue  # one wait per group
            if ev[0] == "wait":
                waited.add(ev[1])
            program.append(ev)
        program += [("op", op)] + posts_after[i]
    return program + [("wait", item) for item in lone_sends if item not in waited]


def plan_all(schedule: Sequence[Sequence[Op]], channel: str = "pp") -> List[List[Event]]:
    """``plan`` for every rank of a schedule (``launcher.core.schedules.build_schedule``)."""
    p = len(schedule)
    return [plan(ops, r, p, channel) for r, ops in enumerate(schedule)]


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
