"""Pre-flight link check at job start (cluster.health_check): a short all-reduce bandwidth probe inside every
node and point-to-point transfers from each node to the next, one link at a time, before training. A degraded NVLink/NIC slows
every rank silently; this names the node whose bandwidth is far below the others'.

Collective: every rank calls ``probe``. Nodes are torchrun's (GROUP_RANK, LOCAL_WORLD_SIZE). On CPU it runs over
gloo (what the tests use); on GPU over NCCL with device tensors.
"""
from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Dict, List, Optional

import torch

from models.backend import compute_device


def verdict(per_node: Dict[str, float], margin: float) -> List[str]:
    """Nodes whose bandwidth is below (1 - margin) x the median of all nodes (needs at least 2 nodes)."""
    if len(per_node) < 2:
        return []
    median = statistics.median(per_node.values())
    return [node for node, bw in sorted(per_node.items()) if median > 0 and bw < (1 - margin) * median]




def _timed(fn, iters: int) -> float:
    fn()  # warm-up (connection set-up, NCCL channels)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def probe(*, size_mb: float = 16.0, iters: int = 5, margin: float = 0.5) -> List[str]:
    """Measure, gather on every rank, and return the report lines (rank 0 prints them)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = max(1, world // local)
    node = rank // local
    numel = max(1, int(size_mb * 2**20 / 4))
    buf = torch.ones(numel, dtype=torch.float32, device=compute_device())
    nbytes = numel * 4

    groups = [dist.new_group(list(range(n * local, (n + 1) * local))) for n in range(nodes)]  # collective
    intra = None
    if local > 1:
        seconds = _timed(lambda: dist.all_reduce(buf, group=groups[node]), iters)
        intra = 2 * (local - 1) / local * nbytes / seconds / 1e9  # all-reduce bus bandwidth, GB/s
    # Inter-node: one link at a time (leader of node k -> leader of node k+1), so a slow link is not hidden by
    # the ring running at its slowest member's pace. Each leader records its outgoing link.
    inter = None
    leaders = list(range(0, world, local))
    leader_group = dist.new_group(leaders) if nodes > 1 else None  # collective
    if nodes > 1 and rank in leaders:
        recv = torch.empty_like(buf)
        for k in range(nodes if nodes > 2 else 1):
            src, dst = leaders[k], leaders[(k + 1) % nodes]
            if rank == src:
                inter = nbytes / _timed(lambda: dist.send(buf, dst), iters) / 1e9
            elif rank == dst:
                _timed(lambda: dist.recv(recv, src), iters)
            dist.barrier(group=leader_group)
    mine = {"node": f"{node}:{socket.gethostname()}", "rank": rank, "intra": intra, "inter": inter}
    every: List[Optional[dict]] = [None] * world
    dist.all_gather_object(every, mine)
    _destroy([*groups, leader_group])
    return report(every, margin=margin, size_mb=size_mb)


def _destroy(groups) -> None:
    """The probe's own groups, torn down once measured: on a GPU each is an NCCL communicator holding device memory
    and connections for the whole run otherwise. Every rank created every group (new_group is collective); each
    destroys the ones it is a member of."""
    import torch.distributed as dist

    for group in groups:
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)


def report(every: List[dict], *, margin: float, size_mb: float) -> List[str]:
    """Lines: per node, its intra-node all-reduce and inter-node ring bandwidth; then the slow nodes, if any."""
    intra: Dict[str, float] = {}
    inter: Dict[str, float] = {}
    for rec in every:
        if rec["intra"] is not None:
            intra[rec["node"]] = min(intra.get(rec["node"], float("inf")), rec["intra"])
        if rec["inter"] is not None:
            inter[rec["node"]] = rec["inter"]
    lines = []
    for node in sorted({rec["node"] for rec in every}):
        parts = [f"intra-node all-reduce {intra[node]:.2f} GB/s" if node in intra else None,
                 f"link to the next node {inter[node]:.2f} GB/s" if node in inter else None]
        lines.append(f"health: node {node}: " + (", ".join(p for p in parts if p) or "single rank, nothing to probe")
                     + f" ({size_mb:g} MB)")
    for kind, values in (("intra-node", intra), ("outgoing inter-node", inter)):
        for node in verdict(values, margin):
            lines.append(f"warning: node {node} {kind} bandwidth {values[node]:.2f} GB/s is more than "
                         f"{margin:.0%} below the median {statistics.median(values.values()):.2f} GB/s of "
                         f"{len(values)} nodes: a degraded link slows every rank")
    return lines
