"""The planner's terms for what a measurement (``action=bench``, launcher/calibration.py) found beyond the
profile's peaks and bandwidths: a fixed cost per eager op (``cluster.op_overhead_us``) and compute units that a
node's ranks share (``cluster.compute_units_per_node``). Both are off by default (0, null): a GPU profile's plans do
not change; on CPU, where four ranks share two cores and the smoke model's small GEMMs cost about as much in
dispatch as in arithmetic, the bench fits them. ``timing.stage_costs`` and ``timing.step_time`` apply them.
Pure Python: no torch, no megatron.
"""
from __future__ import annotations

from launcher.core import Layout
from launcher.plan.host import HOST_OP_S, host_seconds
from launcher.schema import JobConfig


def op_overhead(job: JobConfig, counts: dict, f: float, b: float, parts: dict) -> tuple[float, float]:
    """(f, b) with cluster.op_overhead_us per eager op of the stage's layers added (``counts``: layers by MoE-ness):
    time the device spends per op beyond its FLOPs and bytes, serial with them. A CPU rank issues and runs its own
    ops, and the smoke model's small GEMMs cost about as much in dispatch as in arithmetic; 0 on GPUs (whose host
    issuing overlaps the kernels: the host-time term). The op counts are the host-time model's."""
    per_op = job.cluster.op_overhead_us * 1e-6
    if not per_op:
        return f, b
    extra_f = extra_b = 0.0
    for is_moe, n in counts.items():
        host_f, host_b = host_seconds(job, is_moe)
        extra_f += n * host_f / HOST_OP_S * per_op
        extra_b += n * host_b / HOST_OP_S * per_op
    parts["op_overhead"] = extra_f + extra_b
    return f + extra_f, b + extra_b


def shared_units_s(job: JobConfig, lay: Layout, costs: list, m: int) -> float:
    """The least pipeline time when a node's ranks share cluster.compute_units_per_node compute units (CPU cores):
    the node's busy rank-seconds (every rank's m x (F + B + W) of its stage) over the units. 0 when null (a GPU per
    rank: no sharing)."""
    units = job.cluster.compute_units_per_node
    if not units:
        return 0.0
    per_stage = lay.world // lay.pp  # ranks holding each stage
    on_node = min(lay.world, job.cluster.gpus_per_node) / lay.world  # one node's share of them
    busy = sum(m * (c.f + c.b + c.w) for c in costs) * per_stage * on_node
    return busy / units
