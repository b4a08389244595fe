"""The two Megatron-LM commands of the front door (``launcher/cli.py``):

``python -m launcher import SCRIPT_OR_ARGS_FILE [--output DIR/recipe/NAME.yaml] [--model NAME] [--force]
[cluster=NAME] [name=NAME] [key=value ...] [-- SCRIPT ARGS]`` (``import_main``: a Megatron-LM job -> a recipe), and
``python -m launcher recipe=... action=megatron-args`` (``do_megatron_args``: a job -> a Megatron-LM launch).
Login-node code: no torch, no megatron.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List

IMPORT_USAGE = ("usage: python -m launcher import SCRIPT_OR_ARGS_FILE [--output DIR/recipe/NAME.yaml] [--model NAME] "
                "[--force] [cluster=NAME] [name=NAME] [key=value ...] [-- SCRIPT ARGS ...]")


IMPORT_HELP = """Turn a Megatron-LM pretrain_gpt.py job into a recipe. SCRIPT (a shebang or .sh file) is run by bash with
stand-in torchrun/python/srun/sbatch that only record their arguments; an ARGS_FILE is split as the shell would.
Every argument is reported as mapped, ignored (why) or unsupported (why); the recipe is written (default
recipes/recipe/<stem>.yaml, with a new recipes/model/ entry unless an existing one has the architecture),
composed back, validated and planned. key=value settings go into the recipe (cluster= picks the profile)."""


def do_megatron_args(job, args, checked=None) -> int:
    """action=megatron-args: print the job as a Megatron-LM pretrain_gpt.py launch (or --json); ``checked``: the
    CLI's validation of it (launcher.validate.Checked), whose layout the export reads."""
    import json
    from launcher.megatron_lm.export import to_args
    exported = to_args(job, checked.layout if checked else None)
    if getattr(args, "json", False):
        print(json.dumps({"args": exported.args, "nodes": exported.nodes, "gpus_per_node": exported.gpus_per_node,
                          "env": exported.env, "not_expressible": exported.not_expressible}, indent=2))
    else:
        print(exported.script(f"job {job.name}: {job.model.name} on {job.nodes} x {job.cluster.gpus_per_node} "
                              f"{job.cluster.gpu}"), end="")
    return 0


def import_main(argv: List[str]) -> int:
    """``python -m launcher import ...``: exit 0 when the recipe is written and valid, 2 otherwise."""
    from launcher.megatron_lm.importer import import_job
    from launcher.megatron_lm.translate import ImportError_
    if not argv or argv[0] in ("-h", "--help"):
        print(IMPORT_USAGE + "\n\n" + IMPORT_HELP, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    try:
        opts = _parse_import(argv)
    except ValueError as exc:
        print(f"error: {exc}\n{IMPORT_USAGE}", file=sys.stderr)
        return 2
    try:
        done = import_job(opts["source"], output=opts["output"], model_name=opts["model"],
                          cluster=opts["cluster"], name=opts["name"], script_args=opts["script_args"],
                          extra=opts["extra"], force=opts["force"])
    except (ImportError_, OSError) as exc:
        print(f"error: import {opts['source']}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a composition error of the written recipe (ConfigError), one line
        print(f"error: import {opts['source']}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return _summarise(done)


def _parse_import(argv: List[str]) -> dict:
    opts = {"source": None, "output": None, "model": None, "cluster": None, "name": None, "script_args": [],
            "extra": {}, "force": False}
    it = iter(argv)
    for token in it:
        if token == "--":
            opts["script_args"] = list(it)
        elif token == "--force":
            opts["force"] = True
        elif token in ("--output", "-o", "--model"):
            value = next(it, None)
            if value is None:
                raise ValueError(f"{token} needs a value")
            opts["output" if token != "--model" else "model"] = Path(value) if token != "--model" else value
        elif token.startswith("--"):
            raise ValueError(f"unknown import option {token}")
        elif "=" in token:
            key, value = token.split("=", 1)
            if key in ("cluster", "name"):
                opts[key] = value
            else:
                import yaml
                opts["extra"][key] = yaml.safe_load(value)
        elif opts["source"] is None:
            opts["source"] = Path(token)
        else:
            raise ValueError(f"one source file only (got {opts['source']} and {token})")
    if opts["source"] is None:
        raise ValueError("no script or arguments file given")
    return opts


def _summarise(done) -> int:
    from launcher.actions import summary
    from launcher.problems import errors, report
    from launcher.validate import check
    for entry in done.report:
        print(entry.line())
    counts = {s: sum(e.status == s for e in done.report) for s in ("mapped", "ignored", "unsupported")}
    print(f"{counts['mapped']} mapped, {counts['ignored']} ignored, {counts['unsupported']} unsupported")
    where = f" and model entry {done.new_model}" if done.new_model else f" (model entry {done.model})"
    print(f"wrote {done.recipe_path}{where}")
    checked = check(done.job)
    problems = checked.problems
    report(problems)
    if errors(problems):
        return 2
    from launcher.plan import plan_job
    plan = plan_job(done.job, checked=checked).to_dict()
    print(f"valid: {summary(done.job, checked.layout)}")
    print(f"plan: {plan['gflops_per_token']:.3f} GFLOP/token, peak {plan['peak_gb']:.1f} GB of "
          f"{plan['gpu_memory_gb']:.1f}, MFU {100 * plan['mfu']:.1f}%")
    return 0
