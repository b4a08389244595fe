"""``import-hf``: a Hugging Face model directory -> a weights-only torch_dist checkpoint a job starts from.

1. The HF ``config.json`` is compared with the job's model entry field by field (``arch.compare``): every
   difference is one line, and nothing is built or written.
2. The model is built with Megatron-Core in this one process on the meta device (TP=PP=EP=1, the job's dtype, the
   local spec; its vocabulary padded as the job pads it: ``make_vocab_size_divisible_by`` x the job's TP). Every
   tensor of its sharded state dict is matched to HF tensors through the mapping (``mapping.py``) on shapes alone;
   an HF tensor left unused or a Megatron tensor left unmatched stops the import with one line.
3. ``dist_checkpointing.save`` writes it, each tensor made when its turn comes; ``launcher.json`` marks it
   ``weights_only`` (no optimizer, scheduler, step or RNG state) and records the model fields that shape the
   weights. A job then starts from it with ``checkpoint.load=OUT/iter_0000000`` at any TP/PP/EP layout: torch_dist
   reshards on load.

Streaming: the model is built on the ``meta`` device (shapes only), free host memory and disk are checked against
the bound in :func:`import_hf` first, and each tensor is made from its HF tensors only when the torch_dist writer
reaches it (``stream_in.py``). No GPU is used: the CLI hides CUDA before torch is imported.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from launcher.core.checkpoint.directory import MANIFEST, checkpoint_name
from launcher.core.layout import uses_transformer_engine
from launcher.core.checkpoint.weights import weights_of  # one home: the model fields that shape a checkpoint's tensors
from launcher.hf import arch, mapping
from launcher.schema import JobConfig, ParallelConfig, PrecisionConfig

IGNORED_HF = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
"""Buffers some HF checkpoints carry that are not weights."""
_STACKED = re.compile(r"^((?:decoder|mtp)\.layers)\.(\D.*)$")


class ImportRefused(Exception):
    """The HF checkpoint does not fit the model entry: one line per problem."""

    def __init__(self, lines: List[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


class HFTensors:
    """The tensors of an HF model directory (sharded with an index, or one model.safetensors): names and shapes
    from the headers, each tensor's bytes read when asked for (stream_in.SafetensorsReader)."""

    def __init__(self, root: Path):
        from launcher.hf.stream_in import SafetensorsReader

        index = root / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (root / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise ImportRefused([f"--hf {root}: no model.safetensors(.index.json) there (safetensors weights only; "
                                 "convert .bin weights with transformers first)"])
        self.reader = SafetensorsReader(root, files)
        self.where = {name: str(entry[0].name) for name, entry in self.reader.entries.items()}

    def get(self, name: str) -> torch.Tensor:
        return self.reader.get(name)

    def meta(self, name: str) -> torch.Tensor:
        """The tensor's shape and dtype, no bytes."""
        return torch.empty(self.reader.shape(name), dtype=self.reader.dtype(name), device="meta")


def _logical(key: str, prefix: Tuple[int, ...]) -> Tuple[str, tuple]:
    """A stored key with its leading offsets -> the per-layer name the mapping uses (see torch_dist.Reader)."""
    m = _STACKED.match(key)
    if m and prefix:
        return f"{m[1]}.{prefix[0]}.{m[2]}", tuple(prefix[1:])
    return key, tuple(prefix)


def targets_of(chunk) -> Dict[Tuple[str, tuple], torch.Tensor]:
    """(per-layer checkpoint name, expert index) -> the parameter tensor it is saved from."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for v in nested_values(chunk.sharded_state_dict()):
        if isinstance(v, ShardedTensorFactory):  # gated fc1: built into its two halves, same key and offsets
            first = next(s for s in nested_values(v.build()) if isinstance(s, ShardedTensor))
            prefix = first.global_offset[:first.prepend_axis_num]
        elif isinstance(v, ShardedTensor):
            prefix = v.global_offset[:v.prepend_axis_num]
        else:
            continue
        out[_logical(v.key, tuple(int(i) for i in prefix))] = v.data
    return out


def single_process_group() -> None:
    """A world-1 gloo group for Megatron-Core's build and save in this process: a file store, no port."""
    import tempfile

    import torch.distributed as dist

    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="import-hf-"), "store")
        dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)


class WeightsOnlyCoreAttention(torch.nn.Module):
    """MLA's core attention where Transformer Engine is absent. Megatron-Core's local ``DotProductAttention`` cannot
    take MLA's separate key/value head sizes (``k_channels``/``v_channels``), and core attention holds no weights:
    an import needs only the weights, so this stands in for it (tests/test_catalogue.py builds DeepSeek-V3 the same
    way). Running it is an error."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, *args, **kwargs):
        raise RuntimeError("this model was built to carry weights only (MLA without Transformer Engine)")


def build_single(job: JobConfig, mla_core_attention: type = WeightsOnlyCoreAttention):
    """The job's model at TP=PP=EP=1 in this process (world of one, gloo), its vocabulary padded for the job's TP.
    Standard attention: the local spec. MLA (which the local spec cannot build): the TE-path config with the local
    spec and ``mla_core_attention`` in place of the core attention."""
    from megatron.core import parallel_state, tensor_parallel

    from launcher.core import derive
    from models import backend, build_model, builder, cpu_compat

    single_process_group()
    cpu_compat.apply()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(job.train.seed)
    parallel, precision = ParallelConfig(), PrecisionConfig(dtype=job.precision.dtype, transformer_engine="false")
    layout = replace(builder.layout_of(model=job.model, parallel=parallel, precision=precision),
                     padded_vocab=derive(job).padded_vocab)
    if not job.model.multi_latent_attention:
        [chunk] = build_model(model=job.model, parallel=parallel, precision=precision, layout=layout,
                              seed=job.train.seed)
        return chunk
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from models.mtp import mtp_block_spec

    cfg = builder.transformer_config(model=job.model, parallel=parallel, precision=precision, layout=layout, te=True)
    cfg.gradient_accumulation_fusion = False  # a TE kernel; nothing here trains
    spec = backend.replace_in_spec(backend.decoder_block_spec(cfg, False), {DotProductAttention: mla_core_attention})
    return GPTModel(**builder.gpt_model_kwargs(
        model=job.model, layout=layout, config=cfg, spec=spec, vp_stage=None, pre_process=True, post_process=True,
        mtp_block_spec=mtp_block_spec(cfg, spec, te=False, vp_stage=None)))


@dataclass
class Plan:
    """What the write needs, known before a tensor is read: how to make each parameter, the HF copies to compare
    (DeepSeek-V3's MTP), and the sizes the precheck compares with free memory and disk."""

    producers: Dict[int, Callable[[], torch.Tensor]]
    """Parameter storage (stream_in.storage_key) -> makes the whole parameter from its HF tensors."""
    copies: List[tuple] = field(default_factory=list)
    """(Copy unit, the unit of the main tensor it repeats, the parameter) per HF copy of a shared tensor."""
    largest_group: Tuple[int, str] = (0, "")
    """(bytes, first HF tensor) of the unit whose making holds the most at once (see group_bytes)."""
    model_bytes: int = 0
    """The checkpoint's tensors in the job's dtype (what is written)."""


def group_bytes(hf: HFTensors, names, target) -> int:
    """The most one unit holds at once while it is made and written: its HF tensors, then the joined Megatron
    tensor beside them or beside its dtype conversion, then the converted tensor beside one more copy of (part of)
    it while it is written (a gated fc1's cloned half; the writer's buffer of the bytes: measured 2.5x the output
    layer in all, benchmarks/hf_import_memory.py). Each term is at most the target's element count at the larger of
    the two dtypes."""
    itemsize = max([hf.reader.dtype(n).itemsize for n in names] + [target.dtype.itemsize])
    return sum(hf.reader.nbytes(n) for n in names) + 2 * target.numel() * itemsize


def _make(hf: HFTensors, unit, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    tensors = [hf.get(n) for n in unit.hf]
    value = unit.join(tensors, shape)
    del tensors  # a join that concatenates owns its result: the sources go before the dtype conversion
    return value.to(dtype).contiguous()


def plan_fill(chunk, hf: HFTensors, model) -> Plan:
    """Match every HF tensor to the (meta) Megatron model through the mapping, on shapes and dtypes alone (each join
    runs on the meta device); refuse leftovers on either side, as a fill would. Reads no tensor."""
    from launcher.hf.stream_in import storage_key

    targets = targets_of(chunk)
    used, filled, problems = set(), {}, []
    plan = Plan(producers={})
    for unit in mapping.units(model):
        where = next(((k, unit.index) for k in unit.mcore if (k, unit.index) in targets), None)
        absent = [n for n in unit.hf if n not in hf.where]
        if where is None or absent:
            problems.append(f"{absent[0] if absent else unit.hf[0]}: not in the HF checkpoint" if absent else
                            f"{unit.mcore[0]}: the built model has no such tensor")
            continue
        target = targets[where]
        metas = [hf.meta(n) for n in unit.hf]
        try:
            with torch.device("meta"):  # the joins' own zeros/cat stay shapes only
                value = unit.join(metas, target.shape)
        except (RuntimeError, ValueError):  # e.g. an embedding with more rows than config.json's vocab_size
            value = None
        if value is None or tuple(value.shape) != tuple(target.shape):
            shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(unit.hf, metas))
            problems.append(f"{shapes}: do not make the model's {where[0]} {tuple(target.shape)}")
            continue
        used.update(unit.hf)
        if isinstance(unit, mapping.Copy):  # a second HF copy of a shared tensor: compared before writing
            plan.copies.append((unit, where, target))
            continue
        plan.producers[storage_key(target)] = functools.partial(_make, hf, unit, target.shape, target.dtype)
        plan.largest_group = max(plan.largest_group, (group_bytes(hf, unit.hf, target), unit.hf[0]))
        plan.model_bytes += target.numel() * target.dtype.itemsize
        filled[where] = unit
    plan.copies = [(unit, filled.get(where), target) for unit, where, target in plan.copies]
    for unit, main, target in plan.copies:
        if main is not None:  # both made at once to compare them
            both = group_bytes(hf, unit.hf, target) + group_bytes(hf, main.hf, target)
            plan.largest_group = max(plan.largest_group, (both, unit.hf[0]))
    tied = {"lm_head.weight"} if model.tie_embeddings else set()
    extra = sorted(n for n in hf.where if n not in used and n not in tied and not IGNORED_HF.search(n))
    if extra:
        problems.append(f"{len(extra)} HF tensor(s) have no place in the model entry, e.g. {', '.join(extra[:3])}")
    unfilled = sorted(k for k in targets if k not in filled)
    if unfilled:
        problems.append(f"{len(unfilled)} model tensor(s) got no HF weights, e.g. {unfilled[0][0]}")
    if problems:
        raise ImportRefused(problems)
    return plan


def check_copies(plan: Plan, hf: HFTensors) -> None:
    """Each HF copy of a shared tensor must equal the main copy (in the job's dtype): Megatron-Core's MTP shares
    the embedding and output layer with the main model, so a differing copy cannot be imported as it is."""
    problems = []
    for unit, main, target in plan.copies:
        if main is None:
            continue
        ours = _make(hf, main, target.shape, target.dtype)
        if not torch.equal(_make(hf, unit, target.shape, target.dtype), ours):
            problems.append(f"{unit.hf[0]} differs from the main model's copy, which Megatron-Core's MTP "
                            "shares; it cannot be imported as it is")
        del ours
    if problems:
        raise ImportRefused(problems)


def sharded_for(chunk, model, te: bool) -> dict:
    """The model's sharded state dict under the names the job's layer spec loads (see mapping.te_checkpoint_key)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    state = chunk.sharded_state_dict()
    if te:
        for v in nested_values(state):
            if isinstance(v, (ShardedTensor, ShardedTensorFactory)):
                v.key = mapping.te_checkpoint_key(v.key, model)
    return state


def check(hf_dir: Path, job: JobConfig):
    """The HF ``config.json`` compared with the job's model entry (ImportRefused: one line per differing field);
    returns the transformers config. Reads config.json alone: no weights, no model."""
    from transformers import AutoConfig

    if not (hf_dir / "config.json").is_file():
        raise ImportRefused([f"--hf {hf_dir}: no config.json there (a Hugging Face model directory is needed)"])
    try:
        cfg = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ImportRefused([f"--hf {hf_dir}/config.json: transformers cannot read it "
                             f"({str(exc).splitlines()[0][:160]})"]) from None
    problems = arch.compare(cfg, job.model)
    if problems:
        raise ImportRefused(problems)
    return cfg


MEMORY_MARGIN = 128 * 2**20
"""Beyond the largest unit group: the write path's buffers (torch.save's zip records), the plan's per-tensor
objects, allocator slack. benchmarks/hf_import_memory.py measures what is left of it (docs/measurements.md)."""
DISK_MARGIN, DISK_PER_TENSOR = 16 * 2**20, 8 * 2**10
"""Beyond the tensors' bytes: ``.metadata``, ``common.pt``, metadata.json, and each tensor's torch.save record
(a zip entry of about 1 KB)."""


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def precheck(output: Path, plan: Plan, n_tensors: int, max_memory: Optional[int] = None) -> dict:
    """Free host memory and free disk against the import's bound, before a tensor is read; ImportRefused with one
    line naming what is short. Memory: the largest unit group + MEMORY_MARGIN must fit in what the kernel (or the
    memory cgroup) has available, and under ``max_memory`` (--max-memory) when given."""
    from launcher.hf.stream_in import available_memory, free_disk_bytes

    need_mem = plan.largest_group[0] + MEMORY_MARGIN
    avail, source = available_memory()
    group = f"its largest tensor group ({plan.largest_group[1]} and what it becomes) + {MEMORY_MARGIN >> 20} MiB"
    if max_memory is not None and need_mem > max_memory:
        raise ImportRefused([f"--max-memory {max_memory}: import-hf needs {_gb(need_mem)} of host memory beyond what "
                             f"it holds now ({group}); try --max-memory {-(-need_mem // 10**9)}GB"])
    if need_mem > avail:
        raise ImportRefused([f"host memory={_gb(avail)} available ({source}): import-hf needs {_gb(need_mem)} beyond "
                             f"what it holds now ({group}); try a node (or a Slurm --mem) with "
                             f"{_gb(need_mem - avail)} more free"])
    need_disk = plan.model_bytes + n_tensors * DISK_PER_TENSOR + DISK_MARGIN
    free = free_disk_bytes(output)
    if need_disk > free:
        raise ImportRefused([f"--output {output}: {_gb(free)} free on its filesystem, the checkpoint needs "
                             f"{_gb(need_disk)} (its {n_tensors} tensors in the job's dtype + their records); try an "
                             f"--output on a filesystem with {_gb(need_disk)} free"])
    return {"memory_needed_bytes": need_mem, "memory_available_bytes": avail, "disk_needed_bytes": need_disk,
            "disk_free_bytes": free}


def build_meta(job: JobConfig):
    """The job's model on the ``meta`` device: shapes, dtypes and the sharded state dict, no memory and no GPU.
    CUDA must be hidden (the CLI does so before torch is imported): with a GPU visible, Megatron-Core creates each
    weight on ``torch.cuda.current_device()`` explicitly (use_cpu_initialization=False), which no default-device
    context overrides."""
    if torch.cuda.is_available():
        raise ImportRefused(["CUDA is visible to this process: import-hf never uses a GPU; run it as "
                             "`python -m launcher import-hf ...`, which hides the GPUs, or set CUDA_VISIBLE_DEVICES="])
    with torch.device("meta"):
        chunk = build_single(job)
    on = {p.device.type for p in chunk.parameters()}
    if on != {"meta"}:  # a weight made elsewhere would be held in full: the bound would not hold
        raise RuntimeError(f"import-hf: the model was built on {sorted(on)}, not only on the meta device")
    return chunk


def import_hf(hf_dir: Path, output: Path, job: JobConfig, log=print, spec: Optional[str] = None,
              max_memory: Optional[int] = None) -> Path:
    """Validate, plan, check free memory and disk, write; returns OUT/iter_0000000. ``spec`` (te | local) names the
    layer spec the job's ranks will build, which decides a few norms' names; by default the job's own (Transformer
    Engine on GPUs). ``max_memory``: refuse unless the bound below fits in this many bytes.

    Streams: the model exists only on the meta device, and each tensor is made from its HF tensors when the
    torch_dist writer reaches it (stream_in). Peak host memory (the bound the precheck uses): the resident memory
    before the first tensor is read (Python, torch, Megatron-Core, transformers, the meta model and the save plan:
    about 0.5 GB) + the largest unit group (one Megatron tensor's HF sources, the tensor itself and a converted or
    cloned copy: for an untied Llama the output layer, ~3x its bytes) + MEMORY_MARGIN; never the model. Disk: the
    checkpoint's tensors in the job's dtype + 8 KiB each + 16 MiB."""
    start = time.perf_counter()
    hf_dir, output = Path(hf_dir), Path(output)
    cfg = check(hf_dir, job)
    final = output / checkpoint_name(0)
    if final.exists():
        raise ImportRefused([f"--output {output}: {final} exists already; choose a new directory"])
    hf = HFTensors(hf_dir)
    chunk = build_meta(job)
    plan = plan_fill(chunk, hf, job.model)
    te = uses_transformer_engine(job.precision, job.cluster) if spec is None else spec == "te"
    state = {"model": sharded_for(chunk, job.model, te)}
    checks = precheck(output, plan, len(plan.producers), max_memory)
    from launcher.hf.stream_in import Materializer, rss_bytes, streaming_save

    before_reading = rss_bytes("VmHWM")
    check_copies(plan, hf)
    from megatron.core import dist_checkpointing

    tmp = output / f"{checkpoint_name(0)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with streaming_save(Materializer(plan.producers)):
            dist_checkpointing.save(state, str(tmp))
        files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "crc32": None}
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {"step": 0, "run": "hf-import", "weights_only": True, "source": str(hf_dir.resolve()),
                    "weights_of": weights_of({f"model.{f}": v for f, v in vars(job.model).items()}),
                    "identity": {"data.tokenizer": job.data.tokenizer,
                                 **{f"model.{f}": v for f, v in vars(job.model).items()}},
                    "padded_vocab": int(chunk.embedding.word_embeddings.weight.shape[0]),
                    "dtype": job.precision.dtype, "spec": "te" if te else "local", "files": files,
                    "saved_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str) + "\n")  # last: it makes a checkpoint
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    peak = rss_bytes("VmHWM")
    report = {"checkpoint": str(final), "model_bytes": plan.model_bytes, "largest_group_bytes": plan.largest_group[0],
              "rss_before_reading_bytes": before_reading, "peak_rss_bytes": peak,
              "bound_bytes": before_reading + plan.largest_group[0] + MEMORY_MARGIN,
              "seconds": round(time.perf_counter() - start, 2), **checks}
    log("import-report " + json.dumps(report))  # for benchmarks and tests; the human line stays last
    log(f"imported {hf_dir} ({type(cfg).__name__}) -> {final}: {len(hf.where)} HF tensors, "
        f"{sum(r['size'] for r in files.values()) / 1e6:.1f} MB, {'Transformer Engine' if te else 'local'} spec "
        f"names, {report['seconds']} s; peak RSS {peak / 1e6:.0f} MB ({before_reading / 1e6:.0f} MB before reading "
        f"a tensor; largest tensor group {plan.largest_group[0] / 1e6:.1f} MB; bound {report['bound_bytes'] / 1e6:.0f} "
        f"MB); start a job from it with checkpoint.load={final}")
    return final
