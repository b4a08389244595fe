"""What each action does once a job is composed, valid and through its pre-run checks (``launcher.preflight``).
Each takes the job, the parsed arguments and the checks' context (``Preflight``: problems, layout, and the plan and
signal lead derived once) and returns the process exit code."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from launcher.core import Layout, derive
from launcher.preflight import Preflight
from launcher.problems import EXIT_USAGE, Problem, report
from launcher.schema import JobConfig, Schedule


def summary(job: JobConfig, lay: Layout | None = None) -> str:
    """One line: model, cluster, the derived layout (``lay``: derived if None), schedule, precision, microbatches."""
    lay = lay or derive(job)
    return (f"{job.name}: {job.model.name} on {job.nodes}x{job.cluster.gpus_per_node} {job.cluster.gpu} "
            f"(TP{lay.tp} PP{lay.pp}{f' VPP{lay.vpp}' if lay.vpp > 1 else ''} CP{lay.cp}"
            f"{f' EP{lay.ep}' if lay.ep > 1 else ''} DP{lay.dp}), {job.schedule.kind}, "
            f"{job.precision.dtype}{f'+fp8/{job.precision.fp8}' if job.precision.fp8 else ''}, "
            f"{lay.microbatches} microbatches/step")


def do_validate(job: JobConfig, args, checked: Preflight) -> int:
    print(f"valid: {summary(job, checked.layout)}")
    from launcher.resume_plan import print_plan
    print_plan(job, checked.layout)
    return 0


def do_plan(job: JobConfig, args, checked: Preflight) -> int:
    plan = checked.plan()
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        _print_rich(plan.table())
    _say_calibrated(job, args)
    from launcher.resume_plan import print_plan
    print_plan(job, checked.layout, sys.stderr if args.json else sys.stdout)
    _plan_pictures(job, args, checked)
    return 0


def _plan_pictures(job: JobConfig, args, checked: Preflight) -> None:
    """The 1F1B / interleaved / ZB-H1 pictures of a pipeline (PP > 1), written only where the user asked: into
    ``output_dir`` when it is given on the command line. A plan run from any directory with the default
    ``output_dir`` (``runs``, relative to the directory it is started from) writes nothing and says how to get them."""
    if checked.layout is None or checked.layout.pp < 2:
        return
    out = sys.stderr if args.json else sys.stdout
    if not any(o.lstrip("+").split("=", 1)[0] == "output_dir" for o in args.overrides):
        print(f"schedule pictures: not written; add output_dir=DIR to write {job.name}-schedules.png and "
              f"{job.name}-schedules.trace.json into DIR", file=out)
        return
    from launcher.plan.pictures import draw_job_schedules

    try:
        paths = draw_job_schedules(job, lay=checked.layout)
    except OSError as exc:  # output_dir unwritable, full, a path component that is a file
        print(f"warning: output_dir={job.output_dir!r}: the schedule pictures cannot be written there "
              f"({exc.strerror or exc}); the plan above stands", file=sys.stderr)
        return
    for path in paths:
        print(f"schedule picture: {path}", file=out)


def do_search(job: JobConfig, args, checked: Preflight) -> int:
    from launcher.plan.search import search
    results = search(job, top=10, layout=checked.layout, problems=checked.problems)
    _say_calibrated(job, args)
    if args.json:
        print(json.dumps([c.to_dict() for c in results], indent=2))
        return 0
    if not results:
        print(f"no layout of {job.model.name} fits {job.nodes} x {job.cluster.gpus_per_node} {job.cluster.gpu}; "
              "try more nodes", file=sys.stderr)
        return 1
    _print_rich(search_table(job, results))
    return 0


def _say_calibrated(job: JobConfig, args) -> None:
    """One line when cluster.profile is in use: the predictions above come from calibrated constants."""
    from launcher.calibration import in_use_line

    line = in_use_line(job)
    if line:
        print(line, file=sys.stderr if args.json else sys.stdout)


def do_list(job: JobConfig, args, checked: Preflight) -> int:
    """The recipe catalogue: each model's parameters and its H100/H200 layouts, as the planner predicts them."""
    from launcher.catalog import catalogue_rows, print_table
    rows = catalogue_rows()
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
    else:
        print_table(rows)
    return 0


def _changed(job: JobConfig, overrides: list[str]) -> list[str]:
    """Only the overrides that differ from the job as composed: what the user would actually type."""
    out = []
    for text in overrides:
        key, value = text.split("=", 1)
        current = job
        for part in key.split("."):
            current = getattr(current, part, None)
        shown = "null" if current is None else str(current).lower() if isinstance(current, bool) else str(current)
        if shown != value:
            out.append(text)
    return out


def search_table(job: JobConfig, results):
    """The ranked layouts: what to type, what the planner predicts, and why each ranks where it does."""
    from rich.markup import escape  # overrides are data: "[attn,moe_router]" would be read as a style and dropped
    from rich.table import Table
    table = Table(title=escape(f"{job.model.name} on {job.nodes} x {job.cluster.gpus_per_node} {job.cluster.gpu}: "
                        f"top {len(results)} layouts by predicted throughput"))
    typed = [_changed(job, c.overrides) for c in results]
    for column in ("#", "overrides", "tokens/s", "TFLOP/s/GPU", "MFU", "peak GB", "why"):
        # one whole override a line (the reasons wrap instead): what the user copies onto the command line
        table.add_column(column, overflow="fold", no_wrap=column == "overrides")
    for i, (c, t) in enumerate(zip(results, typed), 1):
        table.add_row(str(i), escape("\n".join(t) or "(this job's layout)"),
                      f"{c.tokens_per_s:,.0f}", f"{c.tflops_per_gpu:.0f}", f"{100 * c.mfu:.1f}%", f"{c.peak_gb:.1f}",
                      escape(c.why))
    return table


def _print_rich(renderable) -> None:
    if isinstance(renderable, str):
        print(renderable)
        return
    from rich.console import Console
    from rich.measure import Measurement

    # 140 columns, or wider where a cell cannot fold narrower (rich would crop the line: a cut-off override or
    # reason); a whole override is what the user copies onto the command line
    wide = Console(width=400)
    Console(width=max(140, Measurement.get(wide, wide.options, renderable).minimum)).print(renderable)


def prepare_bundle(job: JobConfig, args, checked: Preflight):
    """Render and write the bundle from the plan and signal lead the pre-run checks derived (``checked``; refusing
    a predicted OOM unless force, for a context whose checks did not run: bench's). Every check of
    ``launcher.preflight.CHECKS`` for the action has run already (``launcher.cli.main``)."""
    from launcher.plan import oom_message
    from launcher.preflight import oom_problem
    from launcher.render import RenderError, write_bundle

    plan = checked.plan()
    oom = oom_problem(job, plan)
    if oom is not None:
        report([oom])
        print(oom_message(plan, job), file=sys.stderr)
        return None
    try:
        bundle = write_bundle(job, argv=args.overrides, plan=checked.plan_dict(), lay=checked.layout,
                              signal_lead=checked.signal_lead(), timeouts=checked.timeouts())
    except RenderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    except OSError as exc:  # output_dir unwritable, full, or a path component too long
        print(f"error: output_dir={job.output_dir!r}: the bundle cannot be written there ({exc.strerror or exc}"
              f"{': ' + str(exc.filename) if getattr(exc, 'filename', None) else ''}); try output_dir=runs",
              file=sys.stderr)
        return None
    print(f"bundle: {bundle.path}")
    return bundle


def do_render(job: JobConfig, args, checked: Preflight) -> int:
    bundle = prepare_bundle(job, args, checked)
    if bundle is None:
        return EXIT_USAGE
    if job.cluster.launcher == "slurm":
        print(f"submit with: sbatch {bundle.sbatch}   (or re-run with action=submit)")
    else:
        print(f"run with: bash {bundle.launch}   (or re-run with action=run)")
    return 0


def do_submit(job: JobConfig, args, checked: Preflight) -> int:
    from launcher.executor import SlurmExecutor, SubmitError
    bundle = prepare_bundle(job, args, checked)
    if bundle is None:
        return EXIT_USAGE
    try:
        job_id = SlurmExecutor().submit(bundle)
    except SubmitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"submitted: job {job_id}; logs in {bundle.path / 'logs'}")
    if (bundle.path / "post.sbatch").is_file():
        print(f"post steps: job {job_id} submits {bundle.path / 'post.sbatch'} when training ends with DONE "
              "(--dependency=afterok on itself); follow them with python -m launcher status " + str(bundle.path))
    return 0


def do_run(job: JobConfig, args, checked: Preflight) -> int:
    from launcher.executor import LocalExecutor
    from launcher.preflight import checkpoint_preflight
    bundle = prepare_bundle(job, args, checked)
    if bundle is None:
        return EXIT_USAGE
    problem = checkpoint_preflight(job, bundle)  # unwritable / full checkpoint dir: say so before training
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        code = LocalExecutor().run(bundle)
    except KeyboardInterrupt:  # a third Ctrl-C while the executor ended what was left
        code = 130
    print(f"run finished with exit code {code}; bundle: {bundle.path}")
    if code == 0 and (bundle.path / "post.sh").is_file() and (bundle.path / "DONE").is_file():
        code = _run_post(bundle)
    return code


def _run_post(bundle) -> int:
    """post.*: after training ended with DONE, the same steps a Slurm chain's post job runs (post.sh), here and
    now; their exit code is the run's (a chain that could not evaluate must not look like a success)."""
    from launcher.executor import LocalExecutor

    print(f"post: {bundle.path / 'post.sh'} (log: {bundle.path / 'logs' / 'post.log'})", flush=True)
    try:
        code = LocalExecutor().run(bundle, script="post.sh", log_name="post.log")
    except KeyboardInterrupt:
        code = 130
    print(f"post steps finished with exit code {code}; see python -m launcher status {bundle.path}")
    return code


def bench_job(job: JobConfig) -> JobConfig:
    """The measurement run of ``job``: its own layout, model, batch, data and precision, for a few steps, with
    nothing that is not a training step (no evaluation, checkpoint, resume, post steps, profiler, trackers)."""
    from launcher.calibration import BENCH_STEPS

    r = dataclasses.replace
    # the timeline's per-stage forward/backward times are what the op cost is fitted to (interleaved: not recorded)
    timeline = job.schedule.record_timeline or job.schedule.kind != Schedule.INTERLEAVED
    return r(job, name=f"{job.name[:40]}-bench", action="run",
             schedule=r(job.schedule, record_timeline=timeline),
             train=r(job.train, train_steps=BENCH_STEPS, train_tokens=None, eval_interval=0,
                     warmup_steps=min(job.train.warmup_steps, BENCH_STEPS - 1), exit_after_minutes=None,
                     wsd_decay_steps=None, straggler_interval=0),
             checkpoint=r(job.checkpoint, dir=None, load=None, load_hf=None, save_interval=0, save_at_end=False,
                          async_save=False),
             post=r(job.post, export_hf=False, eval=False, lm_eval_tasks=[]),
             logging=r(job.logging, log_interval=1, tensorboard=False, wandb_project=None),
             profile=r(job.profile, kind="none", memory_snapshot=False))


def do_bench(job: JobConfig, args, checked: Preflight) -> int:
    """Run a few steps of the job's own layout here (the bundle's launch.sh, as action=run), compare the measured
    step time and per-stage peak memory with the plan, fit the cluster's GEMM efficiency and write the calibrated
    profile into the bench bundle's report directory (launcher/calibration.py)."""
    from launcher.calibration import calibrate, cannot_stand_in, read_passes
    from launcher.executor import LocalExecutor
    from launcher.validate import check

    if job.cluster.launcher != "local":
        report([Problem("action", "bench", f"the measurement runs on this machine; cluster {job.cluster.name} "
                        "launches through Slurm (a Slurm bench job is not built yet)",
                        "cluster.launcher=local action=bench on the cluster's first node (same profile)")])
        return EXIT_USAGE
    bench = bench_job(job)
    bchecked = check(bench)
    if any(p.severity == "error" for p in bchecked.problems):
        report([p for p in bchecked.problems if p.severity == "error"])
        return EXIT_USAGE
    elsewhere = cannot_stand_in(bench, bchecked.layout)
    if elsewhere is not None:
        report([elsewhere])
        return EXIT_USAGE
    bundle = prepare_bundle(bench, args, Preflight(bench, "run", bchecked.layout, list(bchecked.problems)))
    if bundle is None:
        return EXIT_USAGE
    try:
        code = LocalExecutor().run(bundle)
    except KeyboardInterrupt:
        code = 130
    metrics_file = bundle.path / "report" / "metrics.json"
    if code != 0 or not metrics_file.is_file():
        print(f"error: the bench run failed (exit code {code}); nothing calibrated; see {bundle.path / 'logs'}",
              file=sys.stderr)
        return code or 1
    metrics = json.loads(metrics_file.read_text())
    lay = bchecked.layout
    layout_text = summary(bench, lay).split(": ", 1)[1]
    found = calibrate(bench, metrics, bundle.path / "report", layout_text=layout_text, lay=lay,
                      passes=read_passes(bundle.path))
    _print_bench(bench, lay, metrics, found, args)
    return 0


def _print_bench(job: JobConfig, lay: Layout, metrics: dict, found: dict, args) -> None:
    """Measured vs planned: the step (median after warm-up), the peak memory and the static bytes per stage; the
    fitted terms and their sources; where the profile is and how to select it."""
    from launcher.calibration import STATIC_TOLERANCE, memory_rows

    out = {"measured_step_s": found["measured_step_s"], "planned_step_s": found["planned_step_s"],
           "gemm_efficiency": {"before": found["gemm_efficiency_before"], "fitted": found["gemm_efficiency"]},
           "fitted": {k: {"before": found["before"][k], "fitted": v, "from": found["sources"].get(k)}
                      for k, v in found["fitted"].items()},
           "measured_passes_s": found["measured_passes_s"],
           "planned_with_fit_s": found["planned_with_fit_s"], "at_bound": found["at_bound"],
           "memory_by_stage": memory_rows(job, metrics, lay),
           "profile": found["path"], "bundle": str(Path(found["path"]).parent.parent)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        err = (found["planned_step_s"] - found["measured_step_s"]) / found["measured_step_s"]
        print(f"bench {job.name}: step {found['measured_step_s']:.4g} s measured (median of steps after "
              f"{found['warmup_steps_left_out']} warm-up), {found['planned_step_s']:.4g} s planned ({err:+.0%})")
        for row in out["memory_by_stage"]:
            measured = "n/a" if row["measured_gib"] is None else f"{row['measured_gib']:.3f} GiB ({row['basis']})"
            print(f"  stage {row['stage']}: peak memory planned {row['planned_gb']:.3f} GB (reserve left out), "
                  f"measured {measured}")
            if row["static_measured_bytes"]:
                real, plan_b = row["static_measured_bytes"], row["static_planned_bytes"]
                verdict = "within" if row["static_within_tolerance"] else "NOT within"
                print(f"  stage {row['stage']}: weights + gradient buffers + optimizer state planned "
                      f"{plan_b / 1e6:.3f} MB, measured {real / 1e6:.3f} MB ({(plan_b - real) / real:+.2%}, "
                      f"{verdict} {STATIC_TOLERANCE:.0%})")
        bound = " (at its bound: the plan's other terms alone miss the measurement)" if found["at_bound"] else ""
        for key, value in found["fitted"].items():
            print(f"fitted cluster.{key} {found['before'][key]} -> {value:.4g} (from {found['sources'][key]})")
        print(f"the plan with them: {found['planned_with_fit_s']:.4g} s{bound}")
    print(f"calibrated profile: {found['path']}", file=sys.stderr if args.json else sys.stdout)
    print(f"use it with: cluster={job.cluster.name} cluster.profile={found['path']}  (action=plan, action=search)",
          file=sys.stderr if args.json else sys.stdout)
