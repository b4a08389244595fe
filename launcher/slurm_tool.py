"""``import-hf`` / ``export-hf`` as a Slurm job (``--slurm``): a small bundle, sbatch, the job id.

    python -m launcher import-hf --hf HF_DIR --output CKPT_DIR [key=value ...] cluster=NAME --slurm
    python -m launcher export-hf --checkpoint DIR/iter_N --output OUT cluster=NAME [slurm.time=...] --slurm

A big model's conversion belongs on a compute node (a login node's memory is shared and capped). Both commands stream
with a stated peak bound, so the job asks for exactly one node's share: one task, no GPU, ``--mem`` = that bound +
``SLACK``. Here, on the login side (torch-free: ``launcher/hf`` hands ``--slurm`` over before it imports torch), what
can be seen from here is checked first, one line each when it is not so: sbatch is on PATH, the cluster profile is a
Slurm one, the paths exist, the output is new and its directory takes a file, the bound fits the largest node of the
partition (``sinfo``). Then ``<output_dir>/<command>-<UTC stamp>/`` is written (atomically, as a run bundle is):

    job.sbatch   one node, one task, --mem, slurm.time, the profile's partition/account/extra args and container;
                 srun runs the same command without --slurm, with every path absolute
    env.sh       the cluster profile's environment (the run bundle's template)
    config.yaml  import-hf: the job whose model entry is imported (paths absolute); the step reads it with --config
    tool.json    the command, the step's argv, the bound and what it is made of
    logs/        slurm-<job id>.out
    submission.json, EXIT_CODE   the job id (sbatch), the step's exit code once it has ended

and submitted. The step's own pre-checks (free memory under the job's --mem, free disk, the HF config against the
model entry) run on the compute node before a tensor is read, as they do by hand. ``python -m launcher status`` and
``logs`` show such a bundle (launcher/runs.py).

The FSDP <-> DP conversion has no command of its own: a job whose ``parallel.megatron_fsdp`` differs from its
checkpoint's format converts it on its own ranks while loading (launcher/rank/checkpoint/convert.py), so it runs as a
Slurm job with ``action=submit`` like any training job.

Login-node code: no torch, no megatron, no rank wing, no ``launcher.hf``.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from launcher.schema import JobConfig, ModelConfig

STARTUP_BYTES = 2**30
"""What the conversion process holds before it reads a tensor: Python, torch, Megatron-Core, transformers, the
meta-device model and the save plan. Measured: 526 MB for import-hf, 300 MB for export-hf of a 1.6 GB model
(docs/measurements.md, benchmarks/hf_import_memory.py, hf_export_memory.py); this is twice the larger."""
MARGIN_BYTES = 128 * 2**20
"""Beyond the largest tensor group: import-hf's own MEMORY_MARGIN (launcher/hf/importer.py), the same for export."""
SLACK = 0.25
"""--mem is the bound + this share of it: allocator slack and the job's own shell and srun."""
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2,
            "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element: the schema's precision.dtype, safetensors' dtype names, a checkpoint manifest's dtype."""
EXPORT_COPIES = 3
"""export-hf holds one Megatron tensor and the HF tensors it splits into, and PyTorch's read buffer: measured 2.4x
the largest tensor (benchmarks/hf_export_memory.py); 3x it here."""


class Refused(Exception):
    """One line: what is wrong, with what to try."""


@dataclass(frozen=True)
class Bound:
    """The memory a conversion's process needs, in bytes, and what it is made of (said in the script and tool.json)."""

    bytes: int
    said: str

    @property
    def mem_mb(self) -> int:
        """``--mem`` in MiB: the bound + SLACK, rounded up."""
        return -(-int(self.bytes * (1 + SLACK)) // 2**20)


# ---- the stated bound, torch-free ----------------------------------------------------------------------------

def largest_tensor_elements(model: ModelConfig, padded_vocab: int) -> int:
    """Elements of the model's largest Megatron-Core tensor (TP=1, one expert of a routed MLP): the unit
    import-hf makes and export-hf splits one at a time (launcher/hf/mapping.py's units). From the model entry alone;
    tests/test_hf_slurm.py checks it against the built model of every architecture the converter maps."""
    h, n = model.hidden_size, model.num_attention_heads
    gated = 2 if model.activation == "swiglu" else 1
    sizes = [padded_vocab * h]  # embedding, output layer
    if model.position_embedding == "learned_absolute":
        sizes.append(model.max_position_embeddings * h)
    if model.multi_latent_attention:
        qk = model.qk_head_dim + model.qk_pos_emb_head_dim
        sizes += [n * qk * (model.q_lora_rank or h), (model.q_lora_rank or 0) * h,
                  (model.kv_lora_rank + model.qk_pos_emb_head_dim) * h,
                  n * (model.qk_head_dim + model.v_head_dim) * model.kv_lora_rank, n * model.v_head_dim * h]
    else:
        d = model.kv_channels or h // n
        groups = model.num_query_groups or n
        sizes += [(n + 2 * groups) * d * h, n * d * h]
    from launcher.core.layout import moe_layer_pattern

    if not all(moe_layer_pattern(model)) or model.mtp_num_layers:  # a dense MLP somewhere
        sizes += [gated * model.ffn_hidden_size * h]
    if model.num_experts:
        sizes += [gated * (model.moe_ffn_hidden_size or model.ffn_hidden_size) * h, model.num_experts * h,
                  gated * (model.moe_shared_expert_intermediate_size or 0) * h]
    if model.mtp_num_layers:
        sizes.append(2 * h * h)  # eh_proj
    return max(sizes)


def import_bound(job: JobConfig, hf_itemsize: int) -> Bound:
    """import-hf's bound (launcher/hf/importer.py, ``precheck`` and ``group_bytes``): what it holds before reading +
    its largest tensor group (one Megatron tensor's HF sources, the tensor and one more copy of it at the larger
    dtype; twice that where DeepSeek-V3's MTP copies are compared with the main ones) + its margin."""
    from launcher.core import derive

    n = largest_tensor_elements(job.model, derive(job).padded_vocab)
    group = n * (hf_itemsize + 2 * max(hf_itemsize, ITEMSIZE[job.precision.dtype]))
    group *= 2 if job.model.mtp_num_layers else 1
    total = STARTUP_BYTES + group + MARGIN_BYTES
    return Bound(total, f"{_gb(STARTUP_BYTES)} start-up + {_gb(group)} largest tensor group ({n:,} elements) + "
                        f"{MARGIN_BYTES >> 20} MiB")


def export_bound(model: ModelConfig, padded_vocab: int, itemsize: int) -> Bound:
    """export-hf's bound: what it holds before reading + EXPORT_COPIES x its largest tensor + the margin."""
    n = largest_tensor_elements(model, padded_vocab)
    group = EXPORT_COPIES * n * itemsize
    return Bound(STARTUP_BYTES + group + MARGIN_BYTES,
                 f"{_gb(STARTUP_BYTES)} start-up + {EXPORT_COPIES} x the largest tensor ({n:,} elements, "
                 f"{itemsize} B each) + {MARGIN_BYTES >> 20} MiB")


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def safetensors_itemsize(hf_dir: Path) -> int:
    """The largest element size among an HF directory's safetensors tensors, from the files' JSON headers (8 bytes
    of length, then the header): no tensor is read and no torch is needed."""
    index = hf_dir / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
            else ["model.safetensors"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise Refused(f"--hf {hf_dir}: {index.name} cannot be read ({exc}); is it a Hugging Face model "
                      "directory?") from None
    sizes = {1}
    for name in files:
        path = hf_dir / name
        try:
            with open(path, "rb") as fh:
                (length,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(length))
        except (OSError, ValueError, struct.error) as exc:
            raise Refused(f"--hf {hf_dir}: {name} is not a readable safetensors file ({exc}); safetensors "
                          "weights only (convert .bin weights with transformers first)") from None
        sizes |= {ITEMSIZE.get(str(v.get("dtype")), 8) for k, v in header.items()
                  if k != "__metadata__" and isinstance(v, dict)}
    return max(sizes)


# ---- what can be checked here ---------------------------------------------------------------------------------

def _writable_new(flag: str, output: Path, exists: Callable[[Path], Optional[str]]) -> None:
    """``output`` is new (``exists`` says why not, or None) and its nearest existing directory takes a file."""
    from launcher.core.checkpoint.directory import nearest_existing, write_probe

    taken = exists(output)
    if taken:
        raise Refused(f"{flag} {output}: {taken}; choose a new directory")
    why = write_probe(nearest_existing(output))
    if why:
        raise Refused(f"{flag} {output}: {why}; choose a directory you can write to")


def _import_paths(flags: dict) -> Tuple[Path, Path]:
    from launcher.core.checkpoint.directory import checkpoint_name

    hf, out = Path(_abs(flags["--hf"])), Path(_abs(flags["--output"]))
    if not (hf / "config.json").is_file():
        raise Refused(f"--hf {hf}: no config.json there; try --hf with a Hugging Face model directory (config.json "
                      "and model.safetensors)")
    if not (hf / "model.safetensors.index.json").is_file() and not (hf / "model.safetensors").is_file():
        raise Refused(f"--hf {hf}: no model.safetensors(.index.json) there (safetensors weights only); try "
                      "converting .bin weights with transformers first")
    _writable_new("--output", out, lambda p: f"{p / checkpoint_name(0)} exists already"
                  if (p / checkpoint_name(0)).exists() else None)
    return hf, out


def _export_checkpoint(flags: dict) -> Path:
    """export-hf's --checkpoint as the step will resolve it: an iter_N, or a checkpoint dir's newest."""
    from launcher.core.checkpoint.directory import latest_checkpoint

    path = Path(_abs(flags["--checkpoint"]))
    if (path / "metadata.json").is_file():
        return path
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise Refused(f"--checkpoint {path}: not a torch_dist checkpoint (no metadata.json) and no complete iter_* "
                      "checkpoint under it; pass DIR/iter_N")
    return found


def _abs(path: str) -> str:
    from launcher.core.paths import absolute

    return absolute(path)


def _job(command: str, flags: dict, overrides: List[str]) -> JobConfig:
    """The job: import-hf's model entry and cluster (its overrides or --config); export-hf's cluster and slurm.*
    settings only (its model comes from the checkpoint). Paths absolute, as the login CLI makes them."""
    from launcher.config import ConfigError, compose_job
    from launcher.core.paths import container_relative, with_absolute_paths
    from launcher.overrides import check_override

    typos = [p for p in map(check_override, overrides) if p]
    if typos:
        raise Refused(typos[0].line().removeprefix("error: "))
    if command == "export-hf":
        other = [o for o in overrides if not o.lstrip("+~").startswith(("cluster", "slurm.", "output_dir"))]
        if other:
            raise Refused(f"export-hf --slurm: {other[0]}: only the job's cluster=, cluster.*, slurm.* and "
                          "output_dir settings apply (the model comes from the checkpoint); try cluster=NAME")
    if "--config" in flags and command == "import-hf":
        if overrides:
            raise Refused(f"import-hf: --config {flags['--config']} is the whole job; drop the key=value overrides "
                          f"({overrides[0]}, ...) or --config")
        from launcher.core import load_job

        try:
            job = load_job(Path(flags["--config"]))
        except Exception as exc:  # noqa: BLE001 - OmegaConf's many errors: one line
            raise Refused(f"--config {flags['--config']}: cannot be read as a job ({str(exc).splitlines()[0]})") \
                from None
    else:
        try:
            job = compose_job(overrides)
        except ConfigError as exc:
            raise Refused(exc.problem.line().removeprefix("error: ") if exc.problem is not None else str(exc)) \
                from None
    relative = container_relative(job)
    if relative:
        field, value, rule, hint = relative[0]
        raise Refused(f"{field}={value}: {rule}; try {hint}")
    return with_absolute_paths(job)


def check_cluster(job: JobConfig, which: Optional[Callable[[str], Optional[str]]] = None) -> str:
    """sbatch's path; Refused when this cannot submit: a local cluster profile, or no sbatch on PATH."""
    if job.cluster.launcher != "slurm":
        from launcher import RECIPES_DIR

        slurm = sorted(p.stem for p in (RECIPES_DIR / "cluster").glob("*.yaml")
                       if "\nlauncher: slurm" in "\n" + p.read_text())
        raise Refused(f"cluster={job.cluster.name}: --slurm needs a Slurm cluster profile (cluster.launcher=slurm, "
                      f"not {job.cluster.launcher}); try cluster={slurm[0] if slurm else 'NAME'}"
                      f"{' (' + ', '.join(slurm) + ')' if len(slurm) > 1 else ''}, or drop --slurm to convert here")
    sbatch = (which or shutil.which)("sbatch")
    if sbatch is None:
        raise Refused("--slurm: sbatch is not on PATH; run this on the cluster's Slurm login node, or drop --slurm "
                      "to convert here")
    return sbatch


def node_memory_mb(partition: Optional[str], run=None) -> Optional[Tuple[int, str]]:
    """(MiB, where) of the largest node of ``partition`` (the default one if None) as Slurm sizes it (``sinfo``'s
    RealMemory per node); None when sinfo does not answer (sbatch will say it then)."""
    cmd = ["sinfo", "-h", "-N", "-o", "%m"] + (["-p", partition] if partition else [])
    try:
        out = (run or subprocess.run)(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    sizes = [int(word.rstrip("+")) for word in out.stdout.split() if word.rstrip("+").isdigit()]
    if out.returncode != 0 or not sizes:
        return None
    return max(sizes), f"sinfo: partition {partition or '(default)'}"


def check_memory(bound: Bound, job: JobConfig, run=None) -> None:
    node = node_memory_mb(job.cluster.partition, run)
    if node is not None and bound.mem_mb > node[0]:
        raise Refused(f"--slurm: the conversion needs --mem={bound.mem_mb}M ({bound.said}, + {SLACK:.0%}), more "
                      f"than the largest node has ({node[0]}M, {node[1]}); try a partition with larger nodes "
                      "(cluster.partition=...) or run it on a machine with that much memory without --slurm")


# ---- the bundle -----------------------------------------------------------------------------------------------

def step_argv(command: str, flags: dict, bundle: Path, checkpoint: Optional[Path] = None) -> List[str]:
    """The command the job step runs: the same conversion without --slurm, every path absolute; import-hf reads
    the bundle's config.yaml (the job as composed here)."""
    argv = [command]
    if command == "import-hf":
        argv += ["--hf", _abs(flags["--hf"]), "--output", _abs(flags["--output"]), "--config",
                 str(bundle / "config.yaml")]
        argv += [x for f in ("--spec", "--max-memory") if f in flags for x in (f, flags[f])]
    else:
        argv += ["--checkpoint", str(checkpoint), "--output", _abs(flags["--output"])]
        argv += [x for f in ("--config", "--tokenizer") if f in flags for x in (f, _abs(flags[f]))]
        argv += [x for f in ("--max-shard-size",) if f in flags for x in (f, flags[f])]
    return argv


def render_texts(command: str, job: JobConfig, bundle: Path, argv: List[str], bound: Bound) -> Dict[str, str]:
    """The bundle's text files by name (pure). The run bundle's templates and quoting (launcher/render.py): its
    ``q`` filter on every value that reaches the shell, its env.sh for the profile's environment."""
    from launcher.render import _environment, template_context

    env, ctx = _environment(), template_context(job, bundle)
    ctx.update(command=command, job_name=job.slurm.job_name or command, mem_mb=bound.mem_mb, argv=argv,
               bound_said=bound.said, slack_pct=round(SLACK * 100))
    texts = {"job.sbatch": env.get_template("tool.sbatch.j2").render(**ctx),
             "env.sh": env.get_template("env.sh.j2").render(**ctx)}
    if command == "import-hf":
        from launcher.config import job_to_yaml

        texts["config.yaml"] = job_to_yaml(job)
    return texts


def write(command: str, job: JobConfig, texts_for: Callable[[Path], Dict[str, str]], meta: dict) -> Path:
    """The bundle, written into a hidden sibling and renamed into place (never over an existing one)."""
    from launcher.render import new_bundle_dir

    for _ in range(100):
        final = new_bundle_dir(job).resolve()
        if "\n" in str(final):  # an #SBATCH line would end there and the rest run as a command
            raise Refused(f"output_dir={job.output_dir}: a path with a line break cannot go into an #SBATCH line; "
                          "try output_dir=runs")
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".bundle.", dir=final.parent))
        try:
            for name, text in texts_for(final).items():
                (tmp / name).write_text(text)
            os.chmod(tmp / "job.sbatch", 0o755)
            (tmp / "tool.json").write_text(json.dumps(meta, indent=2) + "\n")
            (tmp / "logs").mkdir()
            os.chmod(tmp, 0o755)
            os.rename(tmp, final)
            return final
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not final.exists():
                raise
    raise Refused(f"output_dir={job.output_dir}: no free bundle name after 100 tries")


def prepare(command: str, flags: dict, overrides: List[str], *, which=None, run=None) -> tuple:
    """Everything before sbatch: the checks, the bound, the bundle. (bundle path, sbatch, bound)."""
    if "--check" in flags:
        raise Refused("import-hf --check reads config.json alone, in a second: drop --slurm")
    job = replace(_job(command, flags, overrides), name=command)  # the bundle's and env.sh's name
    sbatch = check_cluster(job, which)
    checkpoint = None
    if command == "import-hf":
        _import_paths(flags)
        bound = import_bound(job, safetensors_itemsize(Path(_abs(flags["--hf"]))))
    else:
        checkpoint = _export_checkpoint(flags)
        out = Path(_abs(flags["--output"]))
        _writable_new("--output", out, lambda p: "exists and is not empty" if p.is_dir() and any(p.iterdir())
                      else "exists and is a file" if p.exists() and not p.is_dir() else None)
        bound = export_bound(*_checkpoint_model(checkpoint, flags))
    check_memory(bound, job, run)
    meta = {"command": command, "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "bound_bytes": bound.bytes, "bound": bound.said, "slack": SLACK, "mem_mb": bound.mem_mb}

    def texts(final: Path) -> Dict[str, str]:
        meta["argv"] = step_argv(command, flags, final, checkpoint)
        return render_texts(command, job, final, meta["argv"], bound)
    return write(command, job, texts, meta), sbatch, bound


def _checkpoint_model(ckpt: Path, flags: dict) -> Tuple[ModelConfig, int, int]:
    """(model entry, padded vocabulary, bytes per element) of a checkpoint, as export-hf reads them: --config's job,
    else its launcher.json (an import records its dtype and padding; otherwise fp32 and TP 8's padding, the larger)."""
    from launcher.core.checkpoint.directory import read_manifest
    from launcher.core.layout import padded_vocab

    manifest = read_manifest(ckpt) or {}
    if "--config" in flags:
        from launcher.core import load_job

        try:
            model = load_job(Path(flags["--config"])).model
        except Exception as exc:  # noqa: BLE001 - OmegaConf's many errors: one line
            raise Refused(f"--config {flags['--config']}: cannot be read as a job ({str(exc).splitlines()[0]})") \
                from None
    else:
        identity = manifest.get("identity")
        if not isinstance(identity, dict):
            raise Refused(f"--checkpoint {ckpt}: no launcher.json with the run's config (a checkpoint written by "
                          "another tool?); pass --config BUNDLE/config.yaml of the run that wrote it")
        from launcher.core.run_identity import model_of

        model = model_of(identity)
    padded = manifest.get("padded_vocab")
    return model, padded if isinstance(padded, int) else padded_vocab(model, 8), ITEMSIZE.get(manifest.get("dtype"), 4)


def submit(command: str, flags: dict, overrides: List[str]) -> int:
    """``python -m launcher import-hf|export-hf ... --slurm``: check, render, sbatch, say how to follow it."""
    import sys

    from launcher.executor import SlurmExecutor, SubmitError
    from launcher.render import Bundle

    try:
        path, sbatch, bound = prepare(command, flags, overrides)
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bundle = Bundle(path)
    try:
        job_id = SlurmExecutor(sbatch=sbatch).submit(bundle)
    except SubmitError as exc:
        print(f"error: {exc}; the bundle is {path} (sbatch {bundle.sbatch} once fixed)", file=sys.stderr)
        return 2
    print(f"bundle: {path}")
    print(f"submitted: job {job_id} ({command}, 1 node, --mem={bound.mem_mb}M: {bound.said} + {SLACK:.0%})")
    print(f"follow it: python -m launcher status {path}   python -m launcher logs {path} --follow")
    return 0
