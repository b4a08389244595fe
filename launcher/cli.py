"""`python -m launcher [key=value ...]`: compose → validate → plan → render → submit or run.

Bad input never produces a traceback: every user error ends as one line per problem and exit code 2.
Login-node code: nothing here imports torch or megatron.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from launcher.config import ConfigError, compose_dict, secret_problems, secret_value_problems, to_job
from launcher.overrides import check_override
from launcher.problems import EXIT_USAGE, errors, report
from launcher.schema import JobConfig
from launcher.validate import check


@dataclass
class Args:
    overrides: list[str] = field(default_factory=list)
    help: bool = False
    cfg_job: bool = False
    json: bool = False


def parse_args(argv: list[str]) -> Args:
    args, it = Args(), iter(argv)
    for token in it:
        if token in ("-h", "--help"):
            args.help = True
        elif token in ("--cfg", "-c"):
            what = next(it, "job")
            if what != "job":
                raise ConfigError(f"--cfg {what}: only '--cfg job' is supported")
            args.cfg_job = True
        elif token == "--json":
            args.json = True
        elif token.startswith("-"):
            from launcher.megatron_lm.table import cli_flag_hint  # Megatron-LM's and neighbours' flags: a pointer
            values = []  # what follows the flag up to the next flag or key=value: Megatron's nargs='+' values too
            for following in (it if "=" not in token else ()):
                if following.startswith("-") or "=" in following:
                    break
                values.append(following)
            raise ConfigError(cli_flag_hint(token, values[0] if values else None, values[1:]) or
                              f"unknown flag {token}: flags are --help, --cfg job, --json; settings are key=value")
        else:
            args.overrides.append(token)
    return args


def resolve_action(job: JobConfig) -> str:
    if job.action != "default":
        return job.action
    return "run" if job.cluster.launcher == "local" else "render"


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before or after a run: no traceback, the shell's code for SIGINT
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `python -m launcher --help | head`: the reader left; say nothing, as SIGPIPE would
        return _reader_gone()


def _reader_gone() -> int:
    """stdout's reader closed the pipe: point stdout at /dev/null so the interpreter's final flush does not raise
    again (Python's documented recipe, library/signal.html "Note on SIGPIPE"), exit as a process killed by SIGPIPE."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file descriptor (captured in tests)
        pass
    return 141


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["import"]:  # python -m launcher import SCRIPT: a Megatron-LM job -> a recipe
        from launcher.megatron_lm.commands import import_main
        return import_main(argv[1:])
    if argv[:1] in (["runs"], ["status"], ["logs"], ["cancel"]):  # what became of a run bundle (launcher/runs.py)
        from launcher.runs import main as runs_main
        return runs_main(argv)
    if argv[:1] == ["checkpoint-info"]:  # what a checkpoint is: model, layout, formats, step (launcher/resume_plan.py)
        from launcher.resume_plan import info_main
        return info_main(argv[1:])
    try:
        args = parse_args(argv)
        if args.help:
            from launcher.help import help_text
            print(help_text())
            return 0
        bad = [p for p in map(check_override, args.overrides) if p]
        if bad:
            report(bad)
            return EXIT_USAGE
        cfg = compose_dict(args.overrides)
        leaks = secret_problems(cfg)
        if leaks:
            report(leaks)
            return EXIT_USAGE
        if args.cfg_job:
            from omegaconf import OmegaConf
            print(OmegaConf.to_yaml(cfg), end="")
            return 0
        job = to_job(cfg)
        leaks = secret_value_problems(job)
        if leaks:
            report(leaks)
            return EXIT_USAGE
    except ConfigError as exc:
        if exc.problem is not None:
            report([exc.problem])
        else:
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    job, refused = _absolute_paths(job)
    checked = check(job)  # the one validation (and derivation) of this job: the checks and the action read both
    problems = checked.problems
    if refused:  # a relative path with a container image: said once, as the path rule's line
        problems = refused + [p for p in problems if (p.field, str(p.value)) not in
                              {(r.field, r.value) for r in refused}]
    from launcher.preflight import Preflight, print_oom_details, run_checks  # what must hold before a run
    ctx = run_checks(Preflight(job, resolve_action(job), checked.layout, list(problems)))
    report(ctx.problems)
    if any(p.field == "force" and p.severity == "error" for p in ctx.problems):  # a predicted OOM: the one line
        print_oom_details(ctx)                                                  # first, then its stages
    if errors(ctx.problems):
        return EXIT_USAGE
    return run_action(ctx, args)


def _absolute_paths(job: JobConfig) -> tuple[JobConfig, list]:
    """Every relative path of the job made absolute against this directory (launcher/core/paths.py: the one
    rule); with a container image, relative paths are refused instead."""
    from launcher.core.paths import container_relative, with_absolute_paths
    from launcher.problems import Problem

    refused = [Problem(*found) for found in container_relative(job)]
    return (job if refused else with_absolute_paths(job)), refused


def run_action(ctx, args: Args) -> int:
    """The action's handler, given the job as checked (``ctx``: ``launcher.preflight.Preflight``, with its problems,
    layout and the plan and signal lead derived once)."""
    from launcher import actions
    if ctx.action == "megatron-args":
        from launcher.megatron_lm.commands import do_megatron_args
        return do_megatron_args(ctx.job, args, ctx.checked)
    handler = {"validate": actions.do_validate, "plan": actions.do_plan, "search": actions.do_search,
               "render": actions.do_render, "submit": actions.do_submit, "run": actions.do_run,
               "list": actions.do_list, "bench": actions.do_bench}[ctx.action]
    return handler(ctx.job, args, ctx)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
