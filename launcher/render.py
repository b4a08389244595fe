"""Render a validated job into a run bundle: a new directory holding everything needed to run it.

    <output_dir>/<name>-<UTC stamp>/
        config.yaml   resolved, typed config (the rank entry reads this)
        job.sbatch    Slurm batch script: srun starts launch.sh once per node
        launch.sh     the torchrun command for one node
        env.sh        environment from the cluster profile (never secrets)
        rank.sh       profile.kind=nsys only: torchrun's per-rank command, the profiled ranks under nsys
        post.sh       post.* only: export / evaluate every kept checkpoint after training (post.sbatch on Slurm)
        meta.json     launcher git SHA, time, command line
        plan.json     the planner's prediction (when available)
        logs/         Slurm / local logs

The bundle is assembled in a hidden temporary directory and renamed into place, so an interrupted render
never leaves a half-written bundle; an existing bundle is never overwritten. Every value that reaches a
shell script goes through shlex.quote (the ``q`` filter). Login-node code: no torch.
"""
from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from launcher import ROOT
from launcher.config import job_to_yaml
from launcher.core import Layout, derive
from launcher.core.checkpoint.directory import checkpoint_dir
from launcher.core.cuda_env import VAR as CUDA_MAX_CONNECTIONS, job_env
from launcher.core.paths import absolute
from launcher.core import timeouts as timeouts_mod
from launcher.core.signal_lead import lead_for_render, shutdown_timeout_s, step_and_save_s
from launcher.core.time_limit import time_limit_s
from launcher.schema import JobConfig, Profiler

TEMPLATES = ROOT / "slurm"
MASTER_PORT = 29500
UNSET_WHEN_NOT_DERIVED = (CUDA_MAX_CONNECTIONS,)
"""Variables env.sh unsets when the job derives no value for them (launcher/core/cuda_env.py: Megatron-FSDP refuses
1, the MoE all-to-all overlap needs more than 1), so the image's or the submitting shell's value never decides."""


class RenderError(Exception):
    """The rendered scripts would not launch the job's layout (a template/config mismatch)."""


@dataclass(frozen=True)
class Bundle:
    """A rendered run bundle on disk."""

    path: Path

    @property
    def sbatch(self) -> Path:
        return self.path / "job.sbatch"

    @property
    def launch(self) -> Path:
        return self.path / "launch.sh"

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"


def _environment() -> Environment:
    env = Environment(loader=FileSystemLoader(str(TEMPLATES)), undefined=StrictUndefined,
                      keep_trailing_newline=True, autoescape=False)
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env


def template_context(job: JobConfig, bundle_dir: Path, signal_lead: dict | None = None,
                     timeouts: dict | None = None) -> dict:
    """Everything the templates interpolate, derived from the job (no I/O). ``signal_lead`` is
    ``signal_lead.lead_for_render``'s answer; without it a null slurm.signal_lead_s is derived with no plan and
    no measured save (the floor). ``timeouts``: ``launcher.core.timeouts.derive``'s (without: with no plan)."""
    cluster, slurm = job.cluster, job.slurm
    if signal_lead is None:
        signal_lead = lead_for_render(job, time_limit_s(job))
    if timeouts is None:
        timeouts = timeouts_mod.derive(job, step_s=None, save_s=None)
    is_gpu = cluster.gpu != "cpu"
    env = job_env(job)  # cluster.env with CUDA_DEVICE_MAX_CONNECTIONS resolved (core/cuda_env.py)
    return {
        "name": job.name,
        "job_name": slurm.job_name or job.name,
        "nodes": job.nodes,
        "gpus_per_node": cluster.gpus_per_node,
        "gpus_per_node_directive": is_gpu,
        "nproc_per_node": cluster.gpus_per_node,
        "time": slurm.time,
        "partition": cluster.partition,
        "account": cluster.account,
        "exclusive": slurm.exclusive,
        "requeue": slurm.requeue,
        "signal_lead_s": signal_lead["seconds"],
        # torchrun waits this long for ranks saving their stop checkpoint before it kills them (not its 30 s)
        "shutdown_timeout_s": shutdown_timeout_s(signal_lead["seconds"]),
        "max_requeues": slurm.max_requeues,
        "on_hang": slurm.on_hang,
        # torchrun restarts after a rank dies: on by default where a node can fail under a long job.
        "max_restarts": cluster.max_restarts if cluster.max_restarts is not None
        else (3 if cluster.launcher == "slurm" else 0),
        "extra_args": list(slurm.extra_args),
        "bundle": str(bundle_dir),
        "workdir": cluster.workdir or str(ROOT),
        # A local run uses the launcher's own interpreter unless the profile names one.
        "python": sys.executable if cluster.launcher == "local" and cluster.python == "python" else cluster.python,
        "container_image": cluster.container_image,
        "container_mounts": ",".join(cluster.container_mounts),
        "master_port": MASTER_PORT,
        "rendezvous": "c10d" if cluster.launcher == "slurm" else "standalone",
        # cluster.env, plus CUDA_DEVICE_MAX_CONNECTIONS derived from this job where it sets none (core/cuda_env.py)
        "env": sorted(env.items()),
        # what the job derives as unset is unset explicitly: an image's ENV (an NGC base, ours before) or the
        # submitting shell would otherwise decide for every job
        "unset": [var for var in UNSET_WHEN_NOT_DERIVED if var not in env],
        "secret_names": list(cluster.secret_env),
        "collective_timeout_s": timeouts["collective_s"], "collective_timeout_env": timeouts_mod.ENV,
        "hang_s": timeouts["hang_s"], "hang_env": timeouts_mod.HANG_ENV,
        # GPU: NCCL's heartbeat outlasts the collective timeout, and a timed-out collective dumps PyTorch's
        # Flight Recorder trace (every rank's last collectives) into the bundle
        "nccl_env": [(k, v) for k, v in timeouts_mod.gpu_env(timeouts, str(bundle_dir)) if k not in env] if is_gpu
        else [],
        "flight_recorder_dir": str(bundle_dir / timeouts_mod.FLIGHT_RECORDER_DIR),
        # every bundle: the Flight Recorder records each rank's collectives (gloo's too) for the hang evidence
        "fr_env": [(k, v) for k, v in timeouts_mod.fr_env() if k not in env],
        # profile.kind=nsys: torchrun starts rank.sh, which runs the profiled ranks under Nsight Systems
        "nsys": job.profile.kind == Profiler.NSYS,
        "profile_ranks": " ".join(str(r) for r in job.profile.ranks),
        "step_start": job.profile.step_start, "step_end": job.profile.step_end,
        # post.*: the steps after training (post.sh; on Slurm post.sbatch, submitted by job.sbatch at DONE)
        "post": bool(post_steps(job)), "post_steps": " + ".join(post_steps(job)),
    }


def render_texts(job: JobConfig, bundle_dir: Path, signal_lead: dict | None = None,
                 timeouts: dict | None = None) -> dict[str, str]:
    """The bundle's text files, keyed by file name (pure: used by the golden-file tests)."""
    env, ctx = _environment(), template_context(job, bundle_dir, signal_lead, timeouts)
    texts = {
        "config.yaml": job_to_yaml(job),
        "job.sbatch": env.get_template("job.sbatch.j2").render(**ctx),
        "launch.sh": env.get_template("launch.sh.j2").render(**ctx),
        "env.sh": env.get_template("env.sh.j2").render(**ctx),
    }
    if ctx["nsys"]:
        texts["rank.sh"] = env.get_template("rank.sh.j2").render(**ctx)
    if ctx["post"]:
        texts["post.sh"] = env.get_template("post.sh.j2").render(**ctx)
        if job.cluster.launcher == "slurm":
            texts["post.sbatch"] = env.get_template("post.sbatch.j2").render(**ctx)
    return texts


def post_steps(job: JobConfig) -> list[str]:
    """The post.* steps this job runs after training, in their order (launcher/hf/post.py)."""
    p = job.post
    return [name for name, on in (("export_hf", p.export_hf), ("eval", p.eval), ("lm_eval", bool(p.lm_eval_tasks)))
            if on]


def job_checkpoint_dir(job: JobConfig) -> Path | None:
    """checkpoint.dir as the login node reads it (None when the run's checkpoints go into its own bundle): where
    the newest measured save, which the signal lead and the timeouts rest on, is looked for."""
    return checkpoint_dir(job.checkpoint.dir, Path()) if job.checkpoint.dir else None


def signal_lead_of(job: JobConfig, plan: dict | None, lead: dict | None = None) -> dict:
    """The --signal lead (launcher/core/signal_lead.py): explicit, or derived from the newest measured save in
    checkpoint.dir and the plan; a derived lead that leaves under 60 s of the time limit is refused. ``lead``: the
    lead already derived for this job and plan (``launcher.preflight.Preflight.signal_lead``), checked, not
    derived again."""
    limit = time_limit_s(job)
    if lead is None:
        lead = lead_for_render(job, limit, plan, job_checkpoint_dir(job))
    problem = lead_problem(job, lead, limit)
    if problem is not None:
        raise RenderError(problem.line().removeprefix("error: "))
    return lead


def derived_timeouts(job: JobConfig, plan: dict | None) -> dict:
    """The collective and heartbeat timeouts (launcher/core/timeouts.py) from the plan's step time and the save
    time the signal lead uses (measured in checkpoint.dir, else the planner's estimate)."""
    step_s, save_s, _, _ = step_and_save_s(job, plan, job_checkpoint_dir(job))
    return timeouts_mod.derive(job, step_s=step_s, save_s=save_s)


def timeouts_of(job: JobConfig, plan: dict | None, found: dict | None = None) -> dict:
    """``derived_timeouts``; an explicit timeout that cannot work with the planned step is refused. ``found``: the
    timeouts already derived for this job and plan (``launcher.preflight.Preflight.timeouts``), checked, not
    derived again."""
    if found is None:
        found = derived_timeouts(job, plan)
    errors = [p for p in timeouts_problems(job, found) if p.severity == "error"]
    if errors:
        raise RenderError(errors[0].line().removeprefix("error: "))
    return found


def timeouts_problems(job: JobConfig, found: dict) -> list:
    """Explicit timeouts that cannot work with the planned step, or that the first step may outlast (validate
    reports them too: a row of ``launcher.preflight.CHECKS``)."""
    from launcher.problems import Problem

    return [Problem(field, value, rule, hint, severity=severity)
            for field, value, rule, hint, severity in timeouts_mod.problems(job, found)]


def lead_problem(job: JobConfig, lead: dict, limit: int):
    """A derived --signal lead that leaves under 60 s of the time limit: the job could not stop in time (validate
    reports it too: a row of ``launcher.preflight.CHECKS``)."""
    from launcher.problems import Problem

    if lead["source"] != "derived" or lead["seconds"] + 60 <= limit:
        return None
    where = "measured in " + lead["measured_in"] if lead["measured_in"] else "estimated"
    return Problem("slurm.time", job.slurm.time,
                   f"too short to stop in time: a checkpoint save takes about {lead['save_s']:.0f} s ({where}), so "
                   f"the stop must start {lead['seconds']} s before the limit ({lead['factor']:g} x save + a step + "
                   f"{lead['margin_s']} s)", f"slurm.time={_hours(2 * (max(lead['seconds'], 300) + 60))} or an explicit "
                   "slurm.signal_lead_s")


def _hours(seconds: float) -> str:
    """A Slurm time limit of whole hours covering ``seconds``."""
    hours = max(1, -(-int(seconds) // 3600))
    return f"{hours // 24}-{hours % 24:02d}:00:00" if hours >= 24 else f"{hours:02d}:00:00"


def git_revision() -> dict:
    """The launcher checkout's commit and whether it has uncommitted changes (for reproducibility)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"git_sha": git("rev-parse", "HEAD") or "unknown", "git_dirty": bool(git("status", "--porcelain"))}


def new_bundle_dir(job: JobConfig, now: _dt.datetime | None = None) -> Path:
    """A fresh, not yet existing bundle path: <output_dir>/<name>-<UTC stamp>[-n]."""
    base = Path(absolute(job.output_dir))
    stamp = (now or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y%m%d-%H%M%S")
    candidate, n = base / f"{job.name}-{stamp}", 1
    while candidate.exists():
        n += 1
        candidate = base / f"{job.name}-{stamp}-{n}"
    return candidate


def write_bundle(job: JobConfig, *, argv: list[str], plan: dict | None = None,
                 bundle_dir: Path | None = None, lay: Layout | None = None, signal_lead: dict | None = None,
                 timeouts: dict | None = None) -> Bundle:
    """Render, cross-check and write the bundle atomically (temp dir + rename); never overwrites one. Two
    launches in the same second pick the same name: the one whose rename comes second takes the next free name
    (``-2``, ...) and renders again, since the scripts hold their own path. ``lay``: the job's layout (derived
    if None), which the rendered scripts are cross-checked against. ``signal_lead`` and ``timeouts``: what the
    pre-run checks derived from this ``plan`` (``launcher.preflight.Preflight``), derived here when None."""
    lead, timeouts = signal_lead_of(job, plan, signal_lead), timeouts_of(job, plan, timeouts)
    for _ in range(100):
        final = (bundle_dir or new_bundle_dir(job)).resolve()
        texts = render_texts(job, final, lead, timeouts)
        issues = cross_check(job, texts, lay)
        if issues:
            raise RenderError("rendered bundle failed its cross-check: " + "; ".join(issues))
        if _place(job, final, texts, argv, plan, lead, timeouts):
            return Bundle(final)
        if bundle_dir is not None:
            raise RenderError(f"bundle directory {final} exists already; bundles are never overwritten")
    raise RenderError(f"no free bundle name under {final.parent} after 100 tries")


def _place(job: JobConfig, final: Path, texts: dict, argv: list[str], plan: dict | None, lead: dict,
           timeouts: dict) -> bool:
    """Write the bundle into a temporary sibling and rename it to ``final``; False if ``final`` was taken."""
    final.parent.mkdir(parents=True, exist_ok=True)
    meta = {"created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "argv": argv, "name": job.name, **git_revision(), "signal_lead": lead, "timeouts": timeouts}
    tmp = Path(tempfile.mkdtemp(prefix=".bundle.", dir=final.parent))
    try:
        for name, text in texts.items():
            (tmp / name).write_text(text)
        for script in ("job.sbatch", "launch.sh", "rank.sh", "post.sh", "post.sbatch"):
            if script in texts:
                os.chmod(tmp / script, 0o755)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if plan is not None:
            (tmp / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
        (tmp / "logs").mkdir()
        os.chmod(tmp, 0o755)
        if final.exists():
            raise FileExistsError(final)
        os.rename(tmp, final)  # atomic; fails rather than overwrite a non-empty directory that appeared meanwhile
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, FileExistsError) or exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return False
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return True


def atomic_write(path: Path, text: str) -> None:
    """Write a file by writing a temporary sibling and renaming it over the target."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cross_check(job: JobConfig, texts: dict[str, str], lay: Layout | None = None) -> list[str]:
    """Re-read the rendered scripts and confirm they launch exactly the ranks the parallel layout needs
    (``lay``: derived if None)."""
    def find(pattern: str, text: str) -> int | None:
        m = re.search(pattern, text, re.MULTILINE)
        return int(m.group(1)) if m else None

    lay = lay or derive(job)
    nodes = find(r"^#SBATCH --nodes=(\d+)$", texts["job.sbatch"])
    nproc = find(r"--nproc-per-node=(\d+)", texts["launch.sh"])
    tnodes = find(r"--nnodes=(\d+)", texts["launch.sh"])
    issues = []
    if nodes != job.nodes or tnodes != job.nodes:
        issues.append(f"rendered node counts (sbatch {nodes}, torchrun {tnodes}) differ from nodes={job.nodes}")
    world = (nodes or 0) * (nproc or 0)
    if world != lay.world:
        issues.append(f"rendered world size {world} differs from the layout's {lay.world} ranks")
    elif not lay.dp or (job.parallel.data is not None and lay.dp != job.parallel.data):
        issues.append(f"rendered world size {world} does not fit TP x PP x CP = {lay.model_parallel}")
    return issues
