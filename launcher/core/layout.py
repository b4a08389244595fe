"""The derived layout of a job: every number both wings need, computed in exactly one place.

``derive`` never raises, so validation can derive first and then check: a quantity that is undefined for
an invalid job (a TP x PP x CP that does not divide the world, a batch that does not split) is 0.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Tuple

from launcher.schema import ClusterConfig, JobConfig, ModelConfig, ParallelConfig, PrecisionConfig


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
    vpp = par.virtual_pipeline or 1
    etp = par.expert_tensor or tp
    dp = _quotient(world, tp * pp * cp)
    per_step = train.micro_batch_size * dp
    counts = stage_layer_counts(par, model.num_layers)
    return Layout(
        world=world, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, dp=dp,
        expert_dp=_quotient(world, etp * ep * pp),
        sequence_parallel=bool(par.sequence_parallel and tp > 1),
        microbatches=_quotient(train.global_batch_size, per_step),
        microbatch_group=job.schedule.microbatch_group_size or pp,
        steps=train_steps(job), tokens_per_step=train.global_batch_size * model.seq_length,
        padded_vocab=padded_vocab(model, tp), moe_pattern=tuple(moe_layer_pattern(model)),
        stage_layers=tuple(counts), chunk_layers=_chunk_layers(counts, pp, vpp),
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
    """Decoder layers on each pipeline stage (even split, or first/last stage overrides)."""
    p = max(1, parallel.pipeline)
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


def _chunk_layers(counts: list[int], p: int, v: int) -> tuple:
    """With VPP the model is cut into PP x VPP chunks, stage r holding chunks r, r + PP, r + 2 PP, ...
    (Megatron's interleaved assignment); each stage's layers split evenly over its chunks."""
    p, v = max(1, p), max(1, v)
    per_chunk = [max(0, c // v) for c in counts]
    chunks: list[list[tuple]] = [[] for _ in range(p)]
    nxt = 0
    for k in range(v):
        for r in range(p):
            size = per_chunk[r] if k < v - 1 else counts[r] - per_chunk[r] * (v - 1)
            chunks[r].append(tuple(range(nxt, nxt + max(0, size))))
            nxt += max(0, size)
    return tuple(tuple(c) for c in chunks)
