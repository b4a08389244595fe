"""Hugging Face in and out: ``python -m launcher export-hf`` / ``import-hf`` (also ``python -m launcher.hf``).

    python -m launcher export-hf --checkpoint DIR/iter_N --output OUT [--config BUNDLE/config.yaml]
                                 [--tokenizer tokenizer.json] [--max-shard-size 5GB] [--slurm cluster=NAME]
    python -m launcher import-hf --hf HF_DIR --output CKPT_DIR [--spec te|local] [--max-memory 8GB]
                                 [key=value ...]  (the job's overrides) [--slurm]

``--slurm`` runs either as a Slurm job on a compute node instead (launcher/slurm_tool.py, torch-free: handed over
before torch is imported).

Both stream tensor by tensor and never hold the model. import-hf builds the model on the meta device with CUDA
hidden (no GPU is touched), checks free host memory and disk against its bound first (one line if short), and
peaks at what Python, torch, Megatron-Core and transformers take (about 0.5 GB) + its largest tensor group (one
Megatron tensor's HF sources, the tensor and one copy: ~3x the output layer of an untied Llama) + 128 MiB
(launcher/hf/importer.py, ``import_hf``).

A wing of its own (tests/test_layering.py, TOOLS): both commands read or write torch_dist checkpoints, which only
torch and Megatron-Core's ``dist_checkpointing`` can do, so this package imports torch (CPU is enough: one
process, no GPU, no network; it runs on a login node with the ``train`` extra installed). The torch-free login
commands (compose, validate, plan, render, submit) never import it: ``launcher/__main__.py`` hands these two
commands over by module name before the login CLI is imported, and no login module reaches this package.
What it may import: the schema and core, the rank wing's model builder (import builds the model once), the
login side's composition (import-hf takes the job's overrides) and transformers/safetensors.

Megatron-Bridge's ``AutoBridge`` mappings were not used: Bridge is not installable beside this stack here (it
pins its own megatron-core and Transformer Engine, which has no CPU build) and its conversion builds the model at
the target layout on GPUs; the mappings it uses (QKV interleaving, gated fc1, vocabulary padding) are the
Megatron-Core layouts documented in ``mapping.py``, checked here by byte-identical round trips and logits.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

USAGE = {
    "export-hf": "python -m launcher export-hf --checkpoint DIR/iter_N --output OUT [--config BUNDLE/config.yaml] "
                 "[--tokenizer PATH] [--max-shard-size 5GB] [--slurm cluster=NAME [cluster.* slurm.* ...]]",
    "import-hf": "python -m launcher import-hf --hf HF_DIR --output CKPT_DIR [--spec te|local] "
                 "[--config BUNDLE/config.yaml | key=value ...] [--check] [--max-memory 8GB] [--slurm]",
}
SLURM_HELP = ("--slurm: run it as a Slurm job instead (one node, no GPU, --mem = the stated peak bound + 25%, "
              "slurm.time; the cluster profile from cluster=NAME and cluster.*/slurm.* settings): checks the paths, "
              "the output and the cluster here, writes a bundle under output_dir (job.sbatch, env.sh, logs/), "
              "submits it with sbatch and prints the job id (launcher/slurm_tool.py).")
HELP = {
    "import-hf": "Streams: the model is built on the meta device with CUDA hidden (no GPU is used) and each tensor is "
                 "made from its HF tensors when the torch_dist writer reaches it. Peak host memory: what Python, "
                 "torch, Megatron-Core and transformers take (about 0.5 GB) + the largest tensor group (one Megatron "
                 "tensor's HF sources, the tensor and one copy: ~3x the output layer of an untied Llama) + 128 MiB; "
                 "free memory and disk are checked against that first (one line if short). --max-memory SIZE: "
                 "refuse unless that bound (beyond what the process holds after start-up) fits in SIZE. " + SLURM_HELP,
    "export-hf": "Streams: one Megatron tensor and the HF tensors it splits into at a time. " + SLURM_HELP,
}
FLAGS = {"export-hf": {"--checkpoint", "--output", "--config", "--tokenizer", "--max-shard-size", "--slurm"},
         "import-hf": {"--hf", "--output", "--spec", "--config", "--check", "--max-memory", "--slurm"}}
SWITCHES = {"--check", "--slurm"}
"""Flags without a value (import-hf --check: compare config.json with the model entry only, write nothing; --slurm:
submit the command as a Slurm job, launcher/slurm_tool.py)."""
REQUIRED = {"export-hf": ("--checkpoint", "--output"), "import-hf": ("--hf", "--output")}


class UsageError(Exception):
    pass


def parse(command: str, argv: List[str]) -> tuple:
    """(flags, overrides): ``--flag value`` or ``--flag=value`` pairs, and key=value job overrides."""
    flags, overrides, it = {}, [], iter(argv)
    for token in it:
        if token in ("-h", "--help"):
            raise UsageError("help")
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            if name not in FLAGS[command]:
                raise UsageError(f"{command}: unknown flag {name}; flags are {', '.join(sorted(FLAGS[command]))}")
            value = "1" if name in SWITCHES and not eq else value if eq else next(it, None)
            if value is None:
                raise UsageError(f"{command}: {name} needs a value")
            flags[name] = value
        elif "=" in token:
            overrides.append(token)
        else:
            raise UsageError(f"{command}: unexpected argument {token!r}; usage: {USAGE[command]}")
    if command == "export-hf" and overrides and "--slurm" not in flags:  # its cluster profile's, with --slurm only
        raise UsageError(f"{command}: unexpected argument {overrides[0]!r}; usage: {USAGE[command]}")
    missing = [f for f in REQUIRED[command] if f not in flags and not (f == "--output" and "--check" in flags)]
    if missing:
        raise UsageError(f"{command}: {', '.join(missing)} is required; usage: {USAGE[command]}")
    return flags, overrides


def parse_size(text: str, flag: str = "--max-shard-size") -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    for unit, mult in units.items():
        if t.endswith(unit) and t[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * mult)
    if t.isdigit():
        return int(t)
    raise UsageError(f"{flag} {text}: not a size; try {flag} 5GB")


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else ""
    if command not in USAGE:
        print(f"error: the command is export-hf or import-hf, not {command!r}", file=sys.stderr)
        return 2
    try:
        flags, overrides = parse(command, argv[1:])
        if "--slurm" in flags:  # a Slurm job instead: torch-free, torch is never imported in this process
            from launcher.slurm_tool import submit

            return submit(command, flags, overrides)
        return _export(flags) if command == "export-hf" else _import(flags, overrides)
    except UsageError as exc:
        if str(exc) == "help":
            print(f"usage: {USAGE[command]}")
            if command in HELP:
                print(HELP[command])
            return 0
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _export(flags: dict) -> int:
    from launcher.hf.export import ExportError, export

    try:
        export(Path(flags["--checkpoint"]), Path(flags["--output"]),
               config=Path(flags["--config"]) if "--config" in flags else None, tokenizer=flags.get("--tokenizer"),
               max_shard_bytes=parse_size(flags.get("--max-shard-size", "5GB")))
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _import(flags: dict, overrides: List[str]) -> int:
    import os

    if "torch" not in sys.modules:  # its own process (python -m launcher import-hf): no GPU is needed or touched
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from launcher.config import ConfigError, compose_job
    from launcher.hf.importer import ImportRefused, import_hf
    from launcher.overrides import check_override

    typos = [p for p in map(check_override, overrides) if p]  # "did you mean", as the login CLI
    if typos:
        for problem in typos:
            print(problem.line(), file=sys.stderr)
        return 2
    if "--config" in flags and overrides:
        raise UsageError(f"import-hf: --config {flags['--config']} is the whole job; drop the key=value overrides "
                         f"({overrides[0]}, ...) or --config")
    try:
        if "--config" in flags:
            from launcher.core import load_job

            job = load_job(Path(flags["--config"]))
        else:
            job = compose_job(overrides)
    except ConfigError as exc:  # the login CLI's one-line form (launcher/cli.py)
        print(exc.problem.line() if exc.problem is not None else f"error: {exc}", file=sys.stderr)
        return 2
    try:
        spec = flags.get("--spec")
        if spec not in (None, "te", "local"):
            raise UsageError(f"--spec {spec}: the layer spec is te (Transformer Engine) or local; try --spec te")
        if "--check" in flags:
            from launcher.hf.importer import check

            check(Path(flags["--hf"]), job)
            return 0
        max_memory = parse_size(flags["--max-memory"], "--max-memory") if "--max-memory" in flags else None
        import_hf(Path(flags["--hf"]), Path(flags["--output"]), job, spec=spec, max_memory=max_memory)
    except ImportRefused as exc:
        for line in exc.lines:
            print(f"error: {line}", file=sys.stderr)
        return 2
    return 0
