"""``export-hf``: a torch_dist checkpoint -> a Hugging Face model directory, streaming tensor by tensor.

What is read: the checkpoint's ``launcher.json`` (its run's config: the model entry, the tokenizer) or a bundle's
``config.yaml`` (``--config``), then each Megatron-Core tensor of the mapping once, converted and written at once.
Memory: one mapping unit at a time (its Megatron tensor and the HF tensors it splits into: the largest is the
output layer or one layer's fused QKV / fc1), plus the checkpoint's metadata; never the model. The output goes to
``OUT.tmp-<pid>`` and is renamed to ``OUT`` when complete.
"""
from __future__ import annotations

import os
import resource
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

from launcher.core.checkpoint.directory import latest_checkpoint, read_manifest
from launcher.hf import arch, mapping
from launcher.hf.safetensors_out import ShardWriter, nbytes, plan_shards, shard_name, write_index
from launcher.schema import ModelConfig

HF_MODEL_CLASS = {"GPT2Config": "GPT2LMHeadModel"}
"""config class -> its causal-LM class where the name is not <Name>ForCausalLM (config.json's ``architectures``)."""
TORCH_TO_HF = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ExportError(Exception):
    """Bad input: one line, no traceback."""


def peak_rss_bytes() -> int:
    """This process's peak resident memory: VmHWM, which starts afresh at exec (``ru_maxrss`` keeps the peak of the
    process that forked it, so a big parent would hide the export's own figure); ``ru_maxrss`` where there is no
    /proc."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def job_of_checkpoint(ckpt: Path, config: Optional[Path]) -> tuple:
    """(ModelConfig, tokenizer path or None) of the run that wrote ``ckpt``."""
    if config is not None:
        from launcher.core import load_job

        job = load_job(config)
        return job.model, job.data.tokenizer
    identity = (read_manifest(ckpt) or {}).get("identity")
    if not isinstance(identity, dict):
        raise ExportError(f"--checkpoint {ckpt}: no launcher.json with the run's config (a checkpoint written by "
                          "another tool?); pass --config BUNDLE/config.yaml of the run that wrote it")
    from launcher.core.run_identity import model_of

    return model_of(identity), identity.get("data.tokenizer")


def resolve_checkpoint(path: Path) -> Path:
    """An iter_N directory, or a checkpoint dir (its newest complete checkpoint)."""
    if (path / "metadata.json").is_file():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise ExportError(f"--checkpoint {path}: not a torch_dist checkpoint (no metadata.json) and no complete "
                          "iter_* checkpoint under it; pass DIR/iter_N")
    return found


def _tokenizer_file(path: Optional[str]) -> Optional[Path]:
    if not path:
        return None
    p = Path(path)
    if not p.is_absolute() and not p.exists():  # recipe paths are relative to the launcher checkout
        p = Path(__file__).resolve().parents[2] / p
    if p.is_dir():
        p = p / "tokenizer.json"
    return p


def write_tokenizer(src: Optional[Path], out: Path) -> tuple:
    """The run's tokenizer.json as a transformers fast tokenizer (tokenizer.json + tokenizer_config.json);
    returns (bos id, eos id): the end-of-document token the data was prepared with is the EOS."""
    if src is None:
        return None, None
    if not src.is_file():
        raise ExportError(f"data.tokenizer={src}: file not found; pass --tokenizer PATH/tokenizer.json")
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from launcher.rank.tokenizer import find_eod_id

    tok = Tokenizer.from_file(str(src))
    eos_id = find_eod_id(tok)
    eos = tok.id_to_token(eos_id)
    bos = next((t for t in ("<|begin_of_text|>", "<s>", "<|im_start|>") if tok.token_to_id(t) is not None), eos)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    fast.save_pretrained(str(out))
    return tok.token_to_id(bos), eos_id


MEMORY_MARGIN = 128 * 2**20
"""Beyond the largest tensor group (a checkpoint tensor read back and the HF tensors split from it): the reader's
buffers, one shard writer's header, allocator slack (import-hf's margin, launcher/hf/importer.py, for the same
kind of streaming step)."""
DISK_MARGIN, DISK_PER_TENSOR = 16 * 2**20, 256
"""Beyond the tensors' bytes: config.json, generation_config.json, the tokenizer files and the index (16 MiB), and
each tensor's entry in its shard's JSON header."""


def precheck(output: Path, group_bytes: int, out_bytes: int, n_tensors: int) -> None:
    """Free host memory and free disk against export-hf's bound, before a tensor is read or a file written:
    ExportError, one line naming what is short and what to try (import-hf's precheck, for the other direction)."""
    from launcher.hf import stream_in  # the module, so a test can stand in for what the machine has

    gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    need_mem = group_bytes + MEMORY_MARGIN
    avail, source = stream_in.available_memory()
    if need_mem > avail:
        raise ExportError(f"host memory={gb(avail)} available ({source}): export-hf needs {gb(need_mem)} beyond what "
                          f"it holds now (its largest tensor group, read and split, + {MEMORY_MARGIN >> 20} MiB); try "
                          f"a node (or --slurm with a Slurm --mem) with {gb(need_mem - avail)} more free")
    need_disk = out_bytes + n_tensors * DISK_PER_TENSOR + DISK_MARGIN
    free = stream_in.free_disk_bytes(output)
    if need_disk > free:
        raise ExportError(f"--output {output}: {gb(free)} free on its filesystem, the export needs {gb(need_disk)} "
                          f"(its {n_tensors} tensors + headers, config and tokenizer); try an --output on a filesystem "
                          f"with {gb(need_disk)} free")


def export(checkpoint: Path, output: Path, *, config: Optional[Path] = None, tokenizer: Optional[str] = None,
           max_shard_bytes: int = 5 * 10**9, log=print) -> dict:
    """Write the HF model directory; returns what it measured (sizes, peak RSS, seconds)."""
    start = time.perf_counter()
    ckpt = resolve_checkpoint(Path(checkpoint))
    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise ExportError(f"--output {output}: exists and is not empty; choose a new directory")
    model, tok_path = job_of_checkpoint(ckpt, config)
    try:
        arch.family(model)
    except arch.Unsupported as exc:
        raise ExportError(str(exc)) from None
    from launcher.hf.torch_dist import Reader

    reader = Reader(ckpt)
    baseline_rss = peak_rss_bytes()  # torch, transformers, the metadata
    plan, missing = [], []
    for unit in mapping.units(model):
        where = reader.locate(unit.mcore, unit.index)
        if where is None:
            missing.append(unit.mcore[0] + (f"[{','.join(map(str, unit.index))}]" if unit.index else ""))
            continue
        plan.append((unit, where))
    if missing:
        raise ExportError(f"--checkpoint {ckpt}: {len(missing)} tensor(s) of model {model.name} are not in it, e.g. "
                          f"{', '.join(missing[:3])}; is it a checkpoint of this model?")
    dtype = reader.dtype(plan[0][1][0])
    entries, owner, group_bytes = [], [], 0
    for u, (unit, (key, index)) in enumerate(plan):
        meta = torch.empty(reader.shape(key, index), dtype=reader.dtype(key), device="meta")
        outs = unit.split(meta)
        group_bytes = max(group_bytes, nbytes(meta.shape, meta.dtype) + sum(nbytes(o.shape, o.dtype) for o in outs))
        for j, (name, out) in enumerate(zip(unit.hf, outs)):
            entries.append((name, out.shape, out.dtype))
            owner.append((u, j))
    shards = plan_shards(entries, max_shard_bytes)
    precheck(output, group_bytes, sum(nbytes(shape, dt) for _, shape, dt in entries), len(entries))
    tmp = output.with_name(f"{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        weight_map, total = {}, 0
        current, current_u = None, -1
        for k, shard in enumerate(shards):
            name = shard_name(k, len(shards))
            writer = ShardWriter(tmp / name, [entries[i] for i in shard])
            for i in shard:
                u, j = owner[i]
                if u != current_u:  # read and convert the next unit; the previous one is dropped here
                    unit, (key, index) = plan[u]
                    current, current_u = unit.split(reader.read(key, index)), u
                writer.write(entries[i][0], current[j])
                weight_map[entries[i][0]] = name
                total += nbytes(entries[i][1], entries[i][2])
            writer.close()
        write_index(tmp / "model.safetensors.index.json", weight_map, total)
        bos, eos = write_tokenizer(_tokenizer_file(tokenizer or tok_path), tmp)
        cfg = arch.hf_config(model, dtype=TORCH_TO_HF.get(dtype, "float32"), bos_token_id=bos, eos_token_id=eos)
        name = type(cfg).__name__
        cfg.architectures = [HF_MODEL_CLASS.get(name, name.replace("Config", "ForCausalLM"))]
        cfg.save_pretrained(str(tmp))
        from transformers import GenerationConfig

        GenerationConfig(bos_token_id=bos, eos_token_id=eos).save_pretrained(str(tmp))
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ckpt_bytes = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())
    report = {"checkpoint": str(ckpt), "output": str(output), "tensors": len(entries), "shards": len(shards),
              "bytes": total, "checkpoint_bytes": ckpt_bytes, "largest_group_bytes": group_bytes,
              "peak_rss_bytes": peak_rss_bytes(),
              "rss_before_reading_bytes": baseline_rss,
              "seconds": round(time.perf_counter() - start, 2)}
    log(f"exported {ckpt} -> {output}: {len(entries)} tensors, {total / 1e6:.1f} MB in {len(shards)} shard(s), "
        f"{cfg.architectures[0]}; peak RSS {report['peak_rss_bytes'] / 1e6:.0f} MB ({baseline_rss / 1e6:.0f} MB before "
        f"reading a tensor; largest tensor group "
        f"{group_bytes / 1e6:.1f} MB, checkpoint {ckpt_bytes / 1e6:.1f} MB), {report['seconds']} s")
    return report
