"""The derived layout of a job: every number both wings need, computed in exactly one place.

``derive`` never raises, so validation can derive first and then check: a quantity that is undefined for
an invalid job (a TP x PP x CP that does not divide the world, a batch that does not split) is 0.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

from launcher.core.pipeline.schedules import place
from launcher.schema import ClusterConfig, JobConfig, ModelConfig, ParallelConfig, PrecisionConfig, Schedule


@dataclass(frozen=True)
class Layout:
    """What a job amounts to once its defaults are resolved (``derive(job)``)."""

    world: int
    """Ranks: nodes x GPUs (or CPU processes) per node."""
    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    vpp: int
    """Virtual pipeline chunks per pipeline rank (1 without interleaving)."""
    cp: int
    """Context-parallel size."""
    ep: int
    """Expert-parallel size."""
    etp: int
    """Expert tensor-parallel size (parallel.expert_tensor, or TP when null)."""
    dp: int
    """Data-parallel size: world / (TP x PP x CP); 0 when that does not divide."""
    expert_dp: int
    """Expert data-parallel size: world / (ETP x EP x PP); 0 when that does not divide."""
    sequence_parallel: bool
    """Sequence parallelism in effect (requested and TP > 1; Megatron turns it off at TP 1)."""
    microbatches: int
    """Micro-batches per step per pipeline: global batch / (micro batch x DP); 0 when that does not divide."""
    microbatch_group: int
    """Interleaved schedule: micro-batches per virtual stage before switching (schedule value or PP)."""
    steps: int
    """Optimizer steps of the run (train_tokens rounds up to whole steps)."""
    tokens_per_step: int
    """Tokens per optimizer step: global batch x sequence length."""
    padded_vocab: int
    """Embedding rows: vocab_size padded to make_vocab_size_divisible_by x TP (Megatron's rule)."""
    moe_pattern: Tuple[bool, ...]
    """Per decoder layer: True when its MLP is MoE."""
    stage_layers: Tuple[int, ...]
    """Decoder layers on each pipeline stage."""
    chunk_layers: Tuple[Tuple[Tuple[int, ...], ...], ...]
    """Global decoder-layer indices per [stage][virtual chunk] (Megatron's interleaved assignment)."""
    transformer_engine: bool
    """Transformer Engine layers are planned (precision.transformer_engine, auto = on when the cluster has GPUs)."""

    @property
    def model_parallel(self) -> int:
        """TP x PP x CP: ranks holding one model replica."""
        return self.tp * self.pp * self.cp

    @property
    def dp_cp(self) -> int:
        """Ranks over which dense gradients are reduced and the distributed optimizer shards: DP x CP."""
        return self.dp * self.cp

    @property
    def tokens(self) -> int:
        """Tokens the whole run consumes."""
        return self.steps * self.tokens_per_step

    def to_dict(self) -> dict:
        return asdict(self)


def derive(job: JobConfig) -> Layout:
    """The job's layout (never raises; see the module docstring)."""
    par, model, train = job.parallel, job.model, job.train
    world = job.nodes * job.cluster.gpus_per_node
    tp, pp, cp, ep = par.tensor, par.pipeline, par.context, par.expert
    vpp = par.virtual_pipeline or layout_virtual_size(par) or 1
    etp = par.expert_tensor or tp
    dp = _quotient(world, tp * pp * cp)
    per_step = train.micro_batch_size * dp
    sizes = chunk_sizes(par, model.num_layers)
    counts = [sum(row) for row in sizes]
    return Layout(
        world=world, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, dp=dp,
        expert_dp=_quotient(world, etp * ep * pp),
        sequence_parallel=bool(par.sequence_parallel and tp > 1),
        microbatches=_quotient(train.global_batch_size, per_step),
        microbatch_group=job.schedule.microbatch_group_size or pp,
        steps=train_steps(job), tokens_per_step=train.global_batch_size * model.seq_length,
        padded_vocab=padded_vocab(model, tp), moe_pattern=tuple(moe_layer_pattern(model)),
        stage_layers=tuple(counts), chunk_layers=_chunk_layers(sizes, job.schedule.kind),
        transformer_engine=uses_transformer_engine(job.precision, job.cluster),
    )


def _quotient(n: int, d: int) -> int:
    """n / d when d divides n (both positive), else 0."""
    return n // d if d and d > 0 and n > 0 and n % d == 0 else 0


def train_steps(job: JobConfig) -> int:
    """Optimizer steps of the run (train_tokens rounds up to whole steps)."""
    if job.train.train_steps is not None:
        return job.train.train_steps
    per_step = job.train.global_batch_size * job.model.seq_length
    return -(-int(job.train.train_tokens or 0) // per_step) if per_step > 0 else 0


def uses_transformer_engine(precision: PrecisionConfig, cluster: ClusterConfig) -> bool:
    """TE is used when requested, or on 'auto' whenever the cluster has GPUs."""
    if precision.transformer_engine == "auto":
        return cluster.gpu != "cpu"
    return precision.transformer_engine == "true"


def padded_vocab(model: ModelConfig, tp: int) -> int:
    """Embedding rows: vocab_size rounded up to make_vocab_size_divisible_by x TP (Megatron's padding)."""
    unit = max(1, model.make_vocab_size_divisible_by) * max(1, tp)
    return -(-model.vocab_size // unit) * unit


def moe_layer_pattern(model: ModelConfig) -> list[bool]:
    """Which decoder layers have an MoE MLP: layer i is MoE iff i >= moe_first_k_dense and i % freq == 0.

    With moe_first_k_dense = 0 this is Megatron's integer ``--moe-layer-freq`` rule; with k > 0 it is
    DeepSeek-V3's ``first_k_dense_replace`` (Megatron takes that as an explicit list pattern).
    """
    if not model.num_experts:
        return [False] * max(0, model.num_layers)
    freq = max(1, model.moe_layer_freq)
    return [i >= model.moe_first_k_dense and i % freq == 0 for i in range(max(0, model.num_layers))]


def stage_layer_counts(parallel: ParallelConfig, num_layers: int) -> list[int]:
    """Decoder layers on each pipeline stage (even split, first/last stage overrides, embedding/loss counted
    as layers, or an explicit per-chunk layout)."""
    return [sum(row) for row in chunk_sizes(parallel, num_layers)]


LAYOUT_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}
"""Megatron-Core's pipeline-layout letters (``PipelineParallelLayerLayout.parse_str_to_list``)."""


def parse_pipeline_layout(text: str) -> List[str]:
    """Megatron-Core's ``pipeline_model_parallel_layout`` string -> one string of layer letters per virtual
    stage, in virtual-stage order (chunk k*PP + r is stage r's k-th chunk). Same grammar as upstream: ``|``
    separates virtual stages, ``(...)*n`` and ``x*n`` repeat, commas are cosmetic; e.g. ``"Et|(tt|)*30mL"``.
    Raises ValueError on a letter outside E, L, t, m."""
    s = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        s = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), s)
    chunks = s.split("|")
    bad = sorted({ch for ch in s.replace("|", "") if ch not in LAYOUT_CHARS})
    if bad:
        raise ValueError(f"unknown layer letter(s) {bad}; known: E (embedding), t (decoder), m (MTP), L (loss)")
    return chunks


def layout_virtual_size(parallel: ParallelConfig) -> Optional[int]:
    """Virtual stages per pipeline rank implied by parallel.pipeline_model_parallel_layout (None without one,
    or when it cannot be parsed / does not split over the pipeline)."""
    text = parallel.pipeline_model_parallel_layout
    if not text:
        return None
    try:
        n = len(parse_pipeline_layout(text))
    except ValueError:
        return None
    p = max(1, parallel.pipeline)
    return n // p if n % p == 0 and n >= p else None


def chunk_sizes(parallel: ParallelConfig, num_layers: int) -> list[list[int]]:
    """Decoder layers per [stage][virtual chunk], as Megatron-Core builds them (``get_num_layers_to_build``):

    - an explicit ``pipeline_model_parallel_layout``: its ``t`` letters per virtual stage;
    - ``account_for_embedding/loss_in_pipeline_split``: (layers + 1 per counted module) split evenly over
      PP x VPP chunks, the first chunk of stage 0 one layer short for the embedding, the last chunk of the
      last stage one short for the loss;
    - first/last stage overrides, else an even split; each stage's layers split evenly over its chunks.
    Never raises: an invalid split keeps the total right (validation reports it)."""
    p = max(1, parallel.pipeline)
    v = max(1, parallel.virtual_pipeline or layout_virtual_size(parallel) or 1)
    if parallel.pipeline_model_parallel_layout and layout_virtual_size(parallel):
        chunks = parse_pipeline_layout(parallel.pipeline_model_parallel_layout)
        v = len(chunks) // p
        return [[chunks[k * p + r].count("t") for k in range(v)] for r in range(p)]
    emb = bool(parallel.account_for_embedding_in_pipeline_split)
    loss = bool(parallel.account_for_loss_in_pipeline_split)
    if p > 1 and (emb or loss):
        total = num_layers + emb + loss
        each = total // (p * v)
        sizes = [[each] * v for _ in range(p)]
        if emb:
            sizes[0][0] -= 1
        if loss:
            sizes[-1][-1] -= 1
        _fix_total(sizes, num_layers)
        return sizes
    counts = _stage_counts(parallel, num_layers, p)
    sizes = []
    for c in counts:
        per = max(0, c // v)
        sizes.append([per] * (v - 1) + [c - per * (v - 1)])
    return sizes


def _fix_total(sizes: list[list[int]], num_layers: int) -> None:
    """Keep the layer total right for a split that does not divide (validation reports it)."""
    diff = num_layers - sum(map(sum, sizes))
    row = sizes[len(sizes) // 2]
    row[-1] = max(0, row[-1] + diff)


def _stage_counts(parallel: ParallelConfig, num_layers: int, p: int) -> list[int]:
    """Decoder layers on each pipeline stage (even split, or first/last stage overrides)."""
    if p == 1:
        return [num_layers]
    first, last = parallel.first_stage_layers, parallel.last_stage_layers
    middle = p - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    each = rest // middle if middle > 0 else 0
    counts = [each] * p
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    # Any remainder of an invalid split goes to the middle stages so the total stays right.
    for i in range(max(0, num_layers - sum(counts))):
        counts[1 + i % max(1, p - 2)] += 1
    return counts


def _chunk_layers(sizes: list[list[int]], kind: str = Schedule.INTERLEAVED) -> tuple:
    """Global decoder-layer indices per [stage][chunk]: with VPP the model is cut into PP x VPP chunks,
    stage r holding chunks r, r + PP, r + 2 PP, ... (Megatron's interleaved assignment, layer ids in
    virtual-stage order); under zb_v, chunks r and 2 PP - 1 - r (the V, launcher.core.pipeline.schedules.stage_of)."""
    p, v = len(sizes), len(sizes[0]) if sizes else 1
    chunks: list[list] = [[()] * v for _ in range(p)]
    nxt = 0
    for k in range(p * v):
        r, c = place(kind if kind == Schedule.ZB_V and v == 2 else Schedule.INTERLEAVED, p, k)
        size = max(0, sizes[r][c])
        chunks[r][c] = tuple(range(nxt, nxt + size))
        nxt += size
    return tuple(tuple(c) for c in chunks)
