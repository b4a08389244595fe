"""``import-hf``: a Hugging Face model directory -> a weights-only torch_dist checkpoint a job starts from.

1. The HF ``config.json`` is compared with the job's model entry field by field (``arch.compare``): every
   difference is one line, and nothing is built or written.
2. The model is built with Megatron-Core in this one process (TP=PP=EP=1, the job's dtype, the local spec; its
   vocabulary padded as the job pads it: ``make_vocab_size_divisible_by`` x the job's TP). Every tensor of its
   sharded state dict is filled from the HF tensors through the mapping (``mapping.py``); an HF tensor left unused
   or a Megatron tensor left unfilled stops the import with one line.
3. ``dist_checkpointing.save`` writes it; ``launcher.json`` marks it ``weights_only`` (no optimizer, scheduler,
   step or RNG state) and records the model fields that shape the weights. A job then starts from it with
   ``checkpoint.load=OUT/iter_0000000`` at any TP/PP/EP layout: torch_dist reshards on load.

Memory: the whole model once in the job's dtype (it is built to be saved), plus one HF tensor group at a time
(``safe_open`` maps the files lazily).
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from launcher.core.checkpoint_dir import MANIFEST, checkpoint_name
from launcher.core.layout import uses_transformer_engine
from launcher.core.weights import WEIGHT_FIELDS  # one home: the model fields that shape a checkpoint's tensors
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
    """The tensors of an HF model directory (sharded with an index, or one model.safetensors), read lazily."""

    def __init__(self, root: Path):
        from safetensors import safe_open

        index = root / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (root / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise ImportRefused([f"--hf {root}: no model.safetensors(.index.json) there (safetensors weights only; "
                                 "convert .bin weights with transformers first)"])
        self._handles = {f: safe_open(str(root / f), framework="pt") for f in files}
        self.where = {name: f for f, h in self._handles.items() for name in h.keys()}

    def get(self, name: str) -> torch.Tensor:
        return self._handles[self.where[name]].get_tensor(name)


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


def fill(chunk, hf: HFTensors, model) -> None:
    """Copy every HF tensor into the Megatron model through the mapping; refuse leftovers on either side."""
    targets = targets_of(chunk)
    used, filled, problems = set(), set(), []
    for unit in mapping.units(model):
        where = next(((k, unit.index) for k in unit.mcore if (k, unit.index) in targets), None)
        absent = [n for n in unit.hf if n not in hf.where]
        if where is None or absent:
            problems.append(f"{absent[0] if absent else unit.hf[0]}: not in the HF checkpoint" if absent else
                            f"{unit.mcore[0]}: the built model has no such tensor")
            continue
        target = targets[where]
        tensors = [hf.get(n) for n in unit.hf]
        try:
            value = unit.join(tensors, target.shape)
        except (RuntimeError, ValueError):  # e.g. an embedding with more rows than config.json's vocab_size
            value = None
        if value is None or tuple(value.shape) != tuple(target.shape):
            shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(unit.hf, tensors))
            problems.append(f"{shapes}: do not make the model's {where[0]} {tuple(target.shape)}")
            continue
        if isinstance(unit, mapping.Copy):  # a second HF copy of a shared tensor: it must be the same
            if not torch.equal(value.to(target.dtype), target):
                problems.append(f"{unit.hf[0]} differs from the main model's copy, which Megatron-Core's MTP "
                                "shares; it cannot be imported as it is")
            used.update(unit.hf)
            continue
        with torch.no_grad():
            target.copy_(value.to(target.dtype))
        used.update(unit.hf)
        filled.add(where)
    tied = {"lm_head.weight"} if model.tie_embeddings else set()
    extra = sorted(n for n in hf.where if n not in used and n not in tied and not IGNORED_HF.search(n))
    if extra:
        problems.append(f"{len(extra)} HF tensor(s) have no place in the model entry, e.g. {', '.join(extra[:3])}")
    unfilled = sorted(k for k in targets if k not in filled)
    if unfilled:
        problems.append(f"{len(unfilled)} model tensor(s) got no HF weights, e.g. {unfilled[0][0]}")
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


def import_hf(hf_dir: Path, output: Path, job: JobConfig, log=print, spec: Optional[str] = None) -> Path:
    """Validate, build, fill, save; returns OUT/iter_0000000. ``spec`` (te | local) names the layer spec the job's
    ranks will build, which decides a few norms' names; by default the job's own (Transformer Engine on GPUs)."""
    start = time.perf_counter()
    hf_dir, output = Path(hf_dir), Path(output)
    cfg = check(hf_dir, job)
    final = output / checkpoint_name(0)
    if final.exists():
        raise ImportRefused([f"--output {output}: {final} exists already; choose a new directory"])
    hf = HFTensors(hf_dir)
    chunk = build_single(job)
    fill(chunk, hf, job.model)
    from megatron.core import dist_checkpointing

    tmp = output / f"{checkpoint_name(0)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        te = uses_transformer_engine(job.precision, job.cluster) if spec is None else spec == "te"
        dist_checkpointing.save({"model": sharded_for(chunk, job.model, te)}, str(tmp))
        files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "crc32": None}
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {"step": 0, "run": "hf-import", "weights_only": True, "source": str(hf_dir.resolve()),
                    "weights_of": {f"model.{k}": getattr(job.model, k) for k in WEIGHT_FIELDS},
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
    log(f"imported {hf_dir} ({type(cfg).__name__}) -> {final}: {len(hf.where)} HF tensors, "
        f"{sum(r['size'] for r in files.values()) / 1e6:.1f} MB, {'Transformer Engine' if te else 'local'} spec "
        f"names, {time.perf_counter() - start:.1f} s; start a job from it with checkpoint.load={final}")
    return final
