"""What must hold before a run, in one declared, ordered table: ``CHECKS``.

After validation (``launcher.validate.check``: the job's rules and its derived layout) each action runs the rows
that name it, in table order: the rank wing's limits, the data and its token budget, the checkpoint directory and
``checkpoint.load``, what render would refuse from the plan (a predicted OOM, a signal lead the time limit cannot
hold, explicit timeouts the planned step breaks), the Hugging Face start and the resume plan. ``validate`` runs the
rows of the actions that start a run, so it says exactly what render would refuse.

Rows of one ``stage`` are reported together (render's refusals all at once, as before); a stage runs only when
nothing before it is an error (a missing data file makes the plan's token count moot; a refused checkpoint makes
an HF import pointless).

What several rows, the action and render read is computed once, by the ``Preflight`` context handed down the table
and on: the plan (``plan``), the signal lead (``signal_lead``) and the derived timeouts (``timeouts``). A render
plans once and derives its lead once (tests/test_preflight.py counts).

Login-node code: no torch, no megatron (the HF start runs ``python -m launcher import-hf`` in a process of its own).
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from launcher.core import Layout, derive
from launcher.core.checkpoint import directory as cdir
from launcher.core.paths import absolute
from launcher.problems import Problem, errors
from launcher.schema import JobConfig
from launcher.validate import RANK_ACTIONS, Checked, rank_side_limits, verified_hint

DATA_ACTIONS = (*RANK_ACTIONS, "bench", "megatron-args")
"""Actions that read the job's data (plan, search and list only predict: a missing shard does not stop them)."""
RESUME_ACTIONS = (*RANK_ACTIONS, "plan")
"""Actions whose output or run depends on the resume plan (plan prints it; a refused one stops the run)."""


@dataclass
class Preflight:
    """The job on its way to its action: what validation found, and what the checks derive once for every reader.

    ``job`` may be replaced by a row (the HF start sets ``checkpoint.load`` to the import); ``problems`` grows
    down the table. The plan, the signal lead and the timeouts are computed on first use and kept: none of them
    reads ``checkpoint.load`` (the one field a row changes), and the plan reads only validation's layout warnings,
    which no row adds (their fields are data.*, checkpoint.*, slurm.time, timeouts.*, force)."""

    job: JobConfig
    action: str
    layout: Layout | None
    problems: list[Problem] = field(default_factory=list)
    _plan: Any = field(default=None, init=False, repr=False)
    _plan_dict: dict | None = field(default=None, init=False, repr=False)
    _lead: dict | None = field(default=None, init=False, repr=False)
    _timeouts: dict | None = field(default=None, init=False, repr=False)

    @property
    def checked(self) -> Checked:
        """Validation's findings so far, as the planner and the actions read them."""
        return Checked(list(self.problems), self.layout)

    def plan(self):
        """The planner's prediction (``launcher.plan.Plan``), planned once; raises PlanError (each time) when the
        layout cannot be planned."""
        if self._plan is None:
            from launcher.plan import PlanError, plan_job
            try:
                self._plan = plan_job(self.job, checked=self.checked)
            except PlanError as exc:
                self._plan = exc
        if isinstance(self._plan, Exception):
            raise self._plan
        return self._plan

    def plan_dict(self) -> dict:
        """``plan().to_dict()``, once: what the signal lead, the timeouts and the bundle's plan.json read."""
        if self._plan_dict is None:
            self._plan_dict = self.plan().to_dict()
        return self._plan_dict

    def signal_lead(self) -> dict:
        """The --signal lead for this job and plan (``launcher.core.signal_lead.lead_for_render``), derived once:
        the refusal row reads it and render writes it."""
        if self._lead is None:
            from launcher.core.signal_lead import lead_for_render
            from launcher.core.time_limit import time_limit_s
            from launcher.render import job_checkpoint_dir
            self._lead = lead_for_render(self.job, time_limit_s(self.job), self.plan_dict(),
                                         job_checkpoint_dir(self.job))
        return self._lead

    def timeouts(self) -> dict:
        """The collective, hang and heartbeat timeouts for this plan (``launcher.render.derived_timeouts``), once."""
        if self._timeouts is None:
            from launcher.render import derived_timeouts
            self._timeouts = derived_timeouts(self.job, self.plan_dict())
        return self._timeouts


@dataclass(frozen=True)
class Check:
    """One pre-run check: which actions run it, its stage (rows of one stage report together), why it exists."""

    name: str
    actions: tuple[str, ...]
    stage: str
    run: Callable[[Preflight], list[Problem]]
    why: str
    verify_hints: bool = False
    """Its alternatives are re-validated like validation's (``verified_hint``)."""


# ---- the checks ------------------------------------------------------------------------------------------------

def data_problems(job: JobConfig, lay: Layout | None = None) -> list[Problem]:
    """Login-node data pre-flight (files, headers, vocab, blend weights, tokens available vs the tokens the run
    consumes; ``lay``: the job's layout, derived if None)."""
    if job.data.kind != "indexed":
        return []
    from launcher.data_preflight import preflight
    return preflight(job.data, vocab_size=job.model.vocab_size, tokens_needed=(lay or derive(job)).tokens)


def checkpoint_dir_problem(job: JobConfig) -> Problem | None:
    """The checkpoint dir (checkpoint.dir, else the bundle's own under output_dir), or its nearest existing parent,
    takes no file: a Problem, else None."""
    target = cdir.checkpoint_dir(job.checkpoint.dir or job.output_dir, Path())
    why = cdir.write_probe(cdir.nearest_existing(target))
    if why is None:
        return None
    if job.checkpoint.dir:
        return Problem("checkpoint.dir", job.checkpoint.dir, why, "a directory you can write to, or "
                       "checkpoint.dir=null (inside the run's bundle)")
    return Problem("output_dir", job.output_dir, why + " (the bundle and its checkpoints go there)", "output_dir=runs")


def checkpoint_dir_is_a_checkpoint(job: JobConfig) -> Problem | None:
    """``checkpoint.dir`` names one checkpoint (an ``iter_N`` with our manifest, or a dist_checkpointing /
    torch.distributed.checkpoint directory) instead of the directory that holds them: the ranks would find no
    ``iter_*`` inside, start from step 0 and write their checkpoints into it (the user meant to resume). A Problem
    whose alternatives are the directory holding it (resumed from its newest) and loading it; else None."""
    if not job.checkpoint.dir:
        return None
    path = Path(absolute(job.checkpoint.dir))
    manifest = cdir.read_manifest(path)
    ours = isinstance(manifest, dict) and "step" in manifest
    if not (ours or (path / "metadata.json").is_file() or (path / ".metadata").is_file()):
        return None
    what = f"step {manifest['step']}" if ours else "a dist_checkpointing checkpoint"
    parent = Path(job.checkpoint.dir).parent
    newest = cdir.latest_checkpoint(path.parent)
    hint = (f"checkpoint.dir={parent}" if newest is not None and newest.resolve() == path.resolve() else
            f"checkpoint.load={job.checkpoint.dir} checkpoint.dir={parent / 'continued'}")
    return Problem("checkpoint.dir", job.checkpoint.dir,
                   f"is a checkpoint itself ({what}), not the directory that holds them: the run would start from "
                   "step 0 and write into it", hint)


def checkpoint_load_problem(job: JobConfig) -> Problem | None:
    """``checkpoint.load`` is a regular file, or names nothing on this file system (the same one the write probe reads) while
    ``checkpoint.dir`` holds no complete checkpoint of its own to resume instead: the ranks would refuse it after
    the model build. Its alternative: the newest complete checkpoint beside the missing path, else null (start from
    step 0). A Problem, else None."""
    load = job.checkpoint.load
    if load and not job.checkpoint.load_hf and Path(absolute(load)).is_file():  # a checkpoint is a directory
        near = cdir.latest_checkpoint(Path(absolute(load)).parent)
        return Problem("checkpoint.load", load, "is a file; a checkpoint is a directory (iter_N, or the directory "
                       "holding them)", f"checkpoint.load={near}" if near is not None else
                       "checkpoint.load=null (start from step 0)")
    if not load or job.checkpoint.load_hf or Path(absolute(load)).exists():
        return None
    if job.checkpoint.dir and cdir.latest_checkpoint(Path(absolute(job.checkpoint.dir))) is not None:
        return None  # the ranks resume checkpoint.dir's own checkpoints first and never read checkpoint.load
    missing = Path(absolute(load))
    near = next((found for found in (cdir.latest_checkpoint(missing.parent),
                                     cdir.latest_checkpoint(missing.parent.parent)) if found is not None), None)
    hint = f"checkpoint.load={near}" if near is not None else "checkpoint.load=null (start from step 0)"
    return Problem("checkpoint.load", load, "no such checkpoint or directory", hint)


def oom_problem(job: JobConfig, plan) -> Problem | None:
    """A predicted out-of-memory without force=true: render refuses it, and validate says so (the details are
    ``launcher.plan.oom_message``, printed below this line: ``print_oom_details``)."""
    if plan.fits or job.force:
        return None
    peak = plan.peak_stage
    return Problem("force", job.force, f"predicted out of memory: pipeline stage {peak.stage} needs "
                   f"{plan.peak_gb:.1f} GB of the GPU's {plan.gpu_memory_gb:g} GB usable ({plan.name})",
                   "action=search (layouts that fit), or action=plan for the stages' memory, or force=true")


def _planned(row: Callable[[Preflight], list[Problem]]) -> Callable[[Preflight], list[Problem]]:
    """A row that reads the plan finds nothing when the layout cannot be planned (validation said why)."""
    def run(ctx: Preflight) -> list[Problem]:
        from launcher.plan import PlanError
        try:
            ctx.plan()
        except PlanError:
            return []
        return row(ctx)
    run.__name__ = row.__name__
    return run


def _oom(ctx: Preflight) -> list[Problem]:
    found = oom_problem(ctx.job, ctx.plan())
    return [found] if found is not None else []


def _signal_lead(ctx: Preflight) -> list[Problem]:
    """A derived Slurm --signal lead the time limit cannot hold (every bundle holds an sbatch script, whatever
    cluster.launcher says): render's refusal (``launcher.render.signal_lead_of``), said by validate too."""
    from launcher.core.time_limit import time_limit_s
    from launcher.render import lead_problem

    job = ctx.job
    if job.slurm.signal_lead_s is not None:
        return []
    limit, lead = time_limit_s(job), ctx.signal_lead()
    late = lead_problem(job, lead, limit)
    return [] if late is None else [_step_too_long(job, late, lead, limit)]


def _timeouts(ctx: Preflight) -> list[Problem]:
    """Explicit timeouts that cannot work with the planned step (render refuses the errors: ``timeouts_of``)."""
    from launcher.render import timeouts_problems

    t = ctx.job.timeouts
    if all(v is None for v in (t.collective_s, t.hang_s, t.heartbeat_s)):
        return []
    return timeouts_problems(ctx.job, ctx.timeouts())


LONGEST_SENSIBLE_LIMIT_S = 30 * 24 * 3600
"""A time limit past 30 days is no alternative to offer (clusters cap partitions at days; Slurm's own maximum is
a site setting): a job whose single step outlasts the limit needs a smaller step instead."""


def _step_too_long(job: JobConfig, late: Problem, lead: dict, limit: int) -> Problem:
    """The signal-lead refusal, its hint made a real alternative when the planned step alone is what does not fit
    (a global batch of 10^12 is a step of years: the time limit it would take is no answer): the largest global
    batch, a multiple of micro batch x DP, whose planned step leaves the stop its lead, checked by planning it."""
    from launcher.core.signal_lead import lead_for_render
    from launcher.fields import set_value
    from launcher.plan import PlanError, plan_job
    from launcher.render import job_checkpoint_dir, lead_problem
    from launcher.validate.sections import raw_problems

    wanted = 2 * (max(lead["seconds"], 300) + 60)
    if wanted <= LONGEST_SENSIBLE_LIMIT_S or lead["step_s"] <= 0 or job.train.global_batch_size is None:
        return late
    lay = derive(job)
    unit = job.train.micro_batch_size * lay.dp
    batch = job.train.global_batch_size
    # the step is about proportional to the batch: aim at a tenth of the limit, then halve until planned to fit
    target = max(unit, int(batch * (limit / 10) / lead["step_s"]) // unit * unit)
    while target >= unit:
        fixed = copy.deepcopy(job)
        set_value(fixed, "train.global_batch_size", str(target))
        try:
            ok = not any(p.severity == "error" for p in raw_problems(fixed))
            plan = plan_job(fixed).to_dict() if ok else None
        except PlanError:
            ok = False
        if ok and lead_problem(fixed, lead_for_render(fixed, limit, plan, job_checkpoint_dir(fixed)), limit) is None:
            return dataclasses.replace(late, field="train.global_batch_size", value=batch,
                                       rule=f"a step is planned at {lead['step_s']:.3g} s, longer than slurm.time="
                                            f"{job.slurm.time} leaves to run it and stop in time",
                                       hint=f"train.global_batch_size={target}")
        target = target // 2 // unit * unit
    return late


HF_LINE = re.compile(r"^(model\.\w+)=(.*?): (.*); try (model\.\w+=.*)$")
"""import-hf's line for one differing field (launcher/hf/arch.py ``_line``): field=value: rule; try field=value."""


def hf_import_dir(job: JobConfig, lay: Layout | None = None) -> Path:
    """Where checkpoint.load_hf is imported: output_dir/hf-imports/NAME-DIGEST, the digest over the HF directory
    (path, and size and mtime of config.json and every weights file), the whole model entry, the dtype, the layer
    spec and the padded vocabulary: a job that would import the same tensors reuses the import."""
    import hashlib

    from launcher.core.layout import uses_transformer_engine

    src = Path(job.checkpoint.load_hf).resolve()
    files = sorted(p for p in src.iterdir() if p.name == "config.json" or p.name.endswith(
        (".safetensors", ".safetensors.index.json")))
    key = json.dumps({"hf": str(src), "files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files],
                      "model": dataclasses.asdict(job.model), "dtype": job.precision.dtype,
                      "te": uses_transformer_engine(job.precision, job.cluster),
                      "padded_vocab": (lay or derive(job)).padded_vocab}, sort_keys=True, default=str)
    return Path(job.output_dir).resolve() / "hf-imports" / f"{src.name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def hf_start(job: JobConfig, *, import_weights: bool, layout: Layout | None = None) -> tuple[JobConfig, list[Problem]]:
    """checkpoint.load_hf: compare the HF config.json with the model entry (one problem per differing field) and,
    unless only validating, import it (once: an import of the same weights for the same model is reused); the job
    then starts from the import as checkpoint.load, the path every layout loads. Both run in ``python -m launcher
    import-hf``, a process of its own: it needs torch and transformers, which the login commands never import."""
    import subprocess
    import tempfile

    from launcher.core import job_to_yaml
    from launcher.core.checkpoint.directory import read_manifest

    src, out = job.checkpoint.load_hf, hf_import_dir(job, layout)
    final = out / "iter_0000000"
    if read_manifest(final) is None:
        with tempfile.TemporaryDirectory(prefix="load-hf-") as tmp:
            (Path(tmp) / "config.yaml").write_text(job_to_yaml(job))
            cmd = [sys.executable, "-m", "launcher", "import-hf", "--hf", str(src), "--config",
                   str(Path(tmp) / "config.yaml"), *(["--output", str(out)] if import_weights else ["--check"])]
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            return job, _hf_problems(src, proc)
        if not import_weights:
            return job, []
        print(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else f"imported {src} -> {final}")
    else:
        print(f"checkpoint.load_hf={src}: the import {final} of the same weights for this model is reused")
    return dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, load=str(final))), []


def _hf_problems(src: str, proc) -> list[Problem]:
    """import-hf's refusal as problems: a differing model field as that field's own problem, the rest (another
    architecture, a file it cannot read) as checkpoint.load_hf's."""
    lines = [ln[len("error: "):] for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        lines = [f"import-hf failed: {tail}"]
    problems = []
    for line in lines:
        m = HF_LINE.match(line)
        if m:
            try:
                value = ast.literal_eval(m[2])
            except (ValueError, SyntaxError):
                value = m[2]
            problems.append(Problem(m[1], value, m[3], m[4]))
        else:
            problems.append(Problem("checkpoint.load_hf", src, line, "a model entry of that architecture, or "
                                    "checkpoint.load_hf=null"))
    return problems


def _hf(ctx: Preflight) -> list[Problem]:
    """The HF start; to run (not to validate) the job then starts from the import (``ctx.job`` replaced)."""
    if not ctx.job.checkpoint.load_hf:
        return []
    ctx.job, found = hf_start(ctx.job, import_weights=ctx.action != "validate", layout=ctx.layout)
    return found


def _resume(ctx: Preflight) -> list[Problem]:
    from launcher.resume_plan import problems_for
    return problems_for(ctx.job, ctx.layout)


def _one(check: Callable[[JobConfig], Problem | None]) -> Callable[[Preflight], list[Problem]]:
    def run(ctx: Preflight) -> list[Problem]:
        found = check(ctx.job)
        return [found] if found is not None else []
    run.__name__ = check.__name__
    return run


# ---- the table ---------------------------------------------------------------------------------------------------

CHECKS: tuple[Check, ...] = (
    Check("rank-side limits", RANK_ACTIONS, "limits", lambda ctx: rank_side_limits(ctx.job),
          "what this launcher's ranks cannot run yet although Megatron-Core, the planner and the export can",
          verify_hints=True),
    Check("data and token budget", DATA_ACTIONS, "data", lambda ctx: data_problems(ctx.job, ctx.layout),
          "the blend's files, headers, vocabulary and weights, and enough tokens for the run, before any rank "
          "reads them", verify_hints=True),
    Check("checkpoint dir writable", RANK_ACTIONS, "launch", _one(checkpoint_dir_problem),
          "the run's checkpoints (and its bundle) must be writable where they go"),
    Check("checkpoint dir is no checkpoint", RANK_ACTIONS, "launch", _one(checkpoint_dir_is_a_checkpoint),
          "a checkpoint.dir naming one checkpoint would start from step 0 and write into it"),
    Check("checkpoint.load exists", RANK_ACTIONS, "launch", _one(checkpoint_load_problem),
          "the ranks would refuse a missing checkpoint.load only after building the model"),
    Check("predicted out of memory", RANK_ACTIONS, "launch", _planned(_oom),
          "render refuses a plan that does not fit (unless force=true)"),
    Check("signal lead", RANK_ACTIONS, "launch", _planned(_signal_lead),
          "render refuses a time limit too short to checkpoint and stop before Slurm kills the job"),
    Check("explicit timeouts", RANK_ACTIONS, "launch", _planned(_timeouts),
          "render refuses explicit timeouts that no planned step could meet"),
    Check("Hugging Face start", RANK_ACTIONS, "hf", _hf,
          "checkpoint.load_hf's config.json must match the model entry; to run, its weights are imported once"),
    Check("resume plan", RESUME_ACTIONS, "resume", _resume,
          "a checkpoint this job cannot continue from is refused before anything renders"),
)
"""Every pre-run check, in the order it runs and reports."""


def rows_for(action: str) -> list[Check]:
    """The checks ``action`` runs, in order."""
    return [row for row in CHECKS if action in row.actions]


def run_checks(ctx: Preflight, table: tuple[Check, ...] = CHECKS) -> Preflight:
    """Run ``table``'s rows for ``ctx.action`` in order, adding what they find to ``ctx.problems``; a stage runs
    only when nothing before it is an error."""
    stage, blocked = None, False
    for row in table:
        if row.stage != stage:
            stage, blocked = row.stage, bool(errors(ctx.problems))
        if blocked or ctx.action not in row.actions:
            continue
        found = row.run(ctx)
        if row.verify_hints:
            found = [verified_hint(ctx.job, p, ctx.problems) for p in found]
        ctx.problems += found
    return ctx


def print_oom_details(ctx: Preflight) -> None:
    """The stages over the limit, their parts and what to change (``launcher.plan.oom_message``), below the one
    line ``oom_problem`` reports (stderr's first line is the error, as for every refusal): validate and render show
    the same."""
    from launcher.plan import PlanError, oom_message

    try:
        print(oom_message(ctx.plan(), ctx.job), file=sys.stderr)
    except PlanError:
        pass


def checkpoint_preflight(job: JobConfig, bundle) -> str | None:
    """Before a local run, once its bundle exists: the checkpoint dir (or its nearest existing parent) takes a file
    and has room for one checkpoint (the planner's parameter count, launcher/core/checkpoint/directory.py
    estimated_bytes). Returns one problem line, or None. Rank 0 checks again before step 1 (a Slurm job's
    nodes may see other file systems)."""
    target = cdir.checkpoint_dir(job.checkpoint.dir, bundle.path)
    probe_dir = cdir.nearest_existing(target)
    why = cdir.write_probe(probe_dir)
    if why:
        return f"checkpoint.dir={target}: {why}"
    missing = checkpoint_load_problem(job)  # the rule the table applies, not a second one
    if missing is not None:
        return missing.line().removeprefix("error: ")
    try:
        params = json.loads((bundle.path / "plan.json").read_text())["params"]["total"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    full = cdir.space_problem(probe_dir, cdir.estimated_bytes(params, job.precision.dtype))
    return f"checkpoint.dir={target}: {full} ({params:.3g} parameters)" if full else None
