"""Layout search: enumerate valid TP/PP/VPP/CP/EP/micro-batch/recompute layouts, drop those that do not fit,
rank the rest by predicted throughput.

Candidates keep everything else of the job (model, precision, global batch, cluster, nodes). Each candidate's
``Layout`` is derived once, where it is built, and handed to the memory and time models with it; the fitting
ones are pre-ranked, and the best are checked with ``launcher.validate.validate`` (the same rules the launcher
enforces) and timed with the schedule simulator.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from launcher.core import Layout, derive
from launcher.plan import layout_errors
from launcher.core.flops import query_groups
from launcher.plan.memory import GB, memory_per_stage
from launcher.plan.timing import step_time, throughput
from launcher.schema import JobConfig
from launcher.validate import validate

MICRO_BATCH_SIZES = (1, 2, 4)
"""Micro-batch sizes tried."""
CONTEXT_SIZES = (1, 2, 4, 8)
"""Context-parallel sizes tried (GPU clusters only: CP needs Transformer Engine attention)."""
MAX_VIRTUAL = 8
"""Largest virtual-pipeline size tried."""
RECOMPUTE = ("none", "selective", "full")
"""Recompute modes tried."""


@dataclass
class Candidate:
    """One ranked layout."""

    overrides: list[str]
    """Command-line overrides that turn the job into this layout."""
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    step_s: float
    peak_gb: float
    gpu_memory_gb: float
    bubble_fraction: float
    why: str
    """One line: why this layout ranks where it does."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _with(job: JobConfig, **sections) -> JobConfig:
    """A copy of job with some fields of some sections replaced: _with(job, parallel={...}, train={...})."""
    changes = {name: dataclasses.replace(getattr(job, name), **vals) for name, vals in sections.items()}
    return dataclasses.replace(job, **changes)


def candidates(job: JobConfig):
    """Yield (overrides, candidate job, its Layout) for every layout worth checking."""
    model, cl = job.model, job.cluster
    base = derive(job)  # world and TE do not change between candidates
    world, te = base.world, base.transformer_engine
    heads = model.num_attention_heads
    groups = query_groups(model)
    tps = [t for t in _divisors(cl.gpus_per_node) if heads % t == 0 and groups % t == 0]
    cps = [c for c in CONTEXT_SIZES if c == 1 or (te and model.seq_length % (2 * c) == 0)]
    eps = [1]
    if model.num_experts:
        eps = [e for e in _divisors(model.num_experts) if e <= 64]
    uneven = (job.parallel.first_stage_layers, job.parallel.last_stage_layers)
    for tp in tps:
        for cp in cps:
            if world % (tp * cp):
                continue
            for pp in _divisors(world // (tp * cp)):
                splits = []
                if model.num_layers % pp == 0 and pp <= model.num_layers:
                    splits.append((None, None))
                if pp == job.parallel.pipeline and uneven != (None, None):
                    splits.append(uneven)
                for first, last in splits:
                    for vp in _virtual_sizes(model.num_layers, pp, first, last):
                        for ep in eps:
                            yield from _batch_and_recompute(job, tp, cp, pp, vp, ep, first, last)


def _virtual_sizes(layers: int, pp: int, first, last) -> list[int]:
    if pp == 1:
        return [1]
    out = [1]
    for v in range(2, MAX_VIRTUAL + 1):
        if first is None and last is None:
            if layers % (pp * v) == 0:
                out.append(v)
        elif all(x is None or x % v == 0 for x in (first, last)):
            middle = pp - (first is not None) - (last is not None)
            rest = layers - (first or 0) - (last or 0)
            if middle and rest % (middle * v) == 0:
                out.append(v)
    return out


def _batch_and_recompute(job, tp, cp, pp, vp, ep, first, last):
    kind = "interleaved" if vp > 1 else ("zb_h1" if job.schedule.kind == "zb_h1" and pp > 1 else "1f1b")
    par = dict(tensor=tp, pipeline=pp, virtual_pipeline=vp if vp > 1 else None, context=cp, expert=ep,
               sequence_parallel=tp > 1, distributed_optimizer=True, data=None,
               first_stage_layers=first, last_stage_layers=last)
    sched = dict(kind=kind, overlap_p2p_comm=kind == "interleaved",
                 batch_p2p_comm=job.schedule.batch_p2p_comm and not (kind == "interleaved" and pp == 2),
                 microbatch_group_size=None)
    layout = [f"parallel.tensor={tp}", f"parallel.pipeline={pp}",
              f"parallel.virtual_pipeline={vp if vp > 1 else 'null'}", f"parallel.context={cp}"]
    if job.model.num_experts:
        layout.append(f"parallel.expert={ep}")
    layout += [f"parallel.sequence_parallel={'true' if tp > 1 else 'false'}",
               "parallel.distributed_optimizer=true",
               f"parallel.first_stage_layers={first if first is not None else 'null'}",
               f"parallel.last_stage_layers={last if last is not None else 'null'}",
               f"schedule.kind={kind}", f"schedule.overlap_p2p_comm={'true' if kind == 'interleaved' else 'false'}"]
    for mbs in MICRO_BATCH_SIZES:
        sized = _with(job, parallel=par, schedule=sched, train=dict(micro_batch_size=mbs))
        lay = derive(sized)  # recomputation does not change the layout: one derivation serves all three
        # The batch must split into micro-batches over DP, and ETP x EP must tile each stage's ranks.
        if not lay.microbatches or not lay.expert_dp:
            continue
        for rec in RECOMPUTE:
            cand = _with(sized, train=dict(recompute=rec))
            yield layout + [f"train.micro_batch_size={mbs}", f"train.recompute={rec}"], cand, lay


def search(job: JobConfig, top: int = 10) -> list[Candidate]:
    """The ``top`` fitting layouts for job.model on job.nodes x gpus_per_node, fastest first.

    Candidates are valid by construction; memory is predicted for all of them, the fitting ones are
    pre-ranked with the closed-form bubble, then the best few are re-timed with the schedule simulator and
    checked with ``launcher.validate.validate`` (the launcher's own rules) before they are returned."""
    cap = job.cluster.gpu_memory_gb * GB
    fitting = []
    fitted: set = set()  # layouts (all but recompute) that already fit with less recomputation
    for overrides, cand, lay in candidates(job):
        key = tuple(o for o in overrides if not o.startswith("train.recompute="))
        if key in fitted:
            continue  # more recomputation than needed is never faster
        peak = max(s.total for s in memory_per_stage(cand, lay))
        if peak <= cap:
            fitted.add(key)
            fitting.append((overrides, cand, lay, peak, step_time(cand, lay, exact=False).step_s))
    fitting.sort(key=lambda x: x[4])
    results: list[Candidate] = []
    for overrides, cand, lay, peak, _ in fitting:
        if len(results) >= max(3 * top, 20):
            break
        if layout_errors(validate(cand)):
            continue
        st = step_time(cand, lay)
        perf = throughput(cand, st, lay)
        results.append(Candidate(overrides, perf["tokens_per_s"], perf["tflops_per_gpu"], perf["mfu"], st.step_s,
                                 peak / GB, job.cluster.gpu_memory_gb, st.bubble_fraction,
                                 _why(cand, lay, st, peak, cap)))
    results.sort(key=lambda c: -c.tokens_per_s)
    return results[:top]


def _why(job: JobConfig, lay: Layout, st, peak: float, cap: float) -> str:
    tr = job.train
    bits = [f"fits {peak / GB:.1f}/{cap / GB:.0f} GB"]
    if lay.pp > 1:
        bits.append(f"bubble {100 * st.bubble_fraction:.0f}%")
    if tr.recompute != "none":
        bits.append(f"recompute {tr.recompute} costs {st.breakdown_s.get('recompute', 0):.2f} s")
    comm = {k: st.breakdown_s.get(k, 0.0) for k in ("tp_comm", "cp_comm", "ep_comm", "dp_comm")}
    worst = max(comm, key=comm.get)
    if comm[worst] > 0.01 * st.step_s:
        bits.append(f"{worst} {comm[worst]:.2f} s exposed")
    if lay.tp * lay.cp > job.cluster.gpus_per_node:
        bits.append("TPxCP crosses nodes")
    bits.append(f"mbs {tr.micro_batch_size}")
    return "; ".join(bits)
