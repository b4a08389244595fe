"""A run bundle's state, read from the bundle itself (launcher/runs.py shows it: ``runs``, ``status``, ``logs``,
``cancel``).

What the launch leaves there (launch.sh, launcher/rank/entry.py, launcher/rank/progress.py): ``DONE`` (the last
step), ``FAILED`` (one line: why), ``STOPPED`` (at which step, why), ``STOP`` (a stop asked for), ``progress.json``
(each attempt: resumed, reached, saved, outcome, first error), ``logs/rank-0.log`` (the step lines: loss, ms/step),
the checkpoint dir's complete ``iter_N/launcher.json`` and, for Slurm, ``submission.json`` (the job id sbatch gave).
Whether a local run is alive is read from ``/proc``: every process launch.sh starts inherits
``LAUNCHER_BUNDLE=<bundle>`` (env.sh), as launcher/executor.py's cleanup reads it.

Login-node code: no torch, no megatron, no rank wing.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ACTIVE = ("pending", "starting", "running", "stopping")
"""States of a run that has not ended (cancel acts on these only)."""
STEP_LINE = re.compile(r"^step\s+(\d+) \| loss ([0-9.eE+-]+|nan|inf) \|.*?\| ([0-9.]+) ms/step", re.MULTILINE)
SLURM_PENDING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RESV_DEL_HOLD"}
SLURM_ACTIVE = {"RUNNING", "COMPLETING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "RESIZING", "STOPPED"}


@dataclass
class RunInfo:
    """What a bundle says about its run (``--json`` prints these fields)."""

    name: str
    path: str
    model: str = "?"
    recipe: str = "?"
    layout: str = "?"
    world: Optional[int] = None
    scheduler: str = "local"
    job_id: Optional[str] = None
    slurm_state: Optional[str] = None
    state: str = "rendered"
    reason: Optional[str] = None
    step: Optional[int] = None
    total: Optional[int] = None
    loss: Optional[float] = None
    ms_per_step: Optional[float] = None
    eta_s: Optional[float] = None
    attempts: list = field(default_factory=list)
    checkpoint: Optional[str] = None
    pids: list = field(default_factory=list)
    """The run's torchrun agents and ranks alive on this machine (local runs)."""
    helpers: list = field(default_factory=list)
    """Other processes of the bundle still alive (a rank's checkpoint writer or loader workers)."""
    created: Optional[str] = None
    post: Optional[str] = None
    """The post.* steps after training (launcher/hf/post.py): None (none asked), waiting (training first), pending,
    running, done, failed, not run (training did not end with DONE)."""
    post_job_id: Optional[str] = None
    post_reason: Optional[str] = None
    score: Optional[float] = None
    """Perplexity of the newest evaluated checkpoint (its eval.json)."""
    evals: list = field(default_factory=list)
    """Each kept checkpoint's eval.json (oldest first), with its ``path`` and its ``hf`` export, if any."""


def read_text(path: Path, limit: int = 2000) -> Optional[str]:
    """The first ``limit`` characters of a small file, stripped; None when it cannot be read."""
    try:
        return path.read_text(errors="replace")[:limit].strip()
    except OSError:
        return None


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tail(path: Path, size: int = 65536) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - size))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def live_processes() -> dict[str, list[int]]:
    """bundle path -> PIDs of this machine's processes started for it (they inherited ``LAUNCHER_BUNDLE``)."""
    found: dict[str, list[int]] = {}
    me = os.getpid()
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        start = env.find(b"LAUNCHER_BUNDLE=")
        if start >= 0 and (start == 0 or env[start - 1] == 0):
            value = env[start + len(b"LAUNCHER_BUNDLE="):].split(b"\0", 1)[0].decode(errors="replace")
            found.setdefault(os.path.normpath(value), []).append(int(entry.name))
    return found


def _cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def training(pids: list[int], agents_only: bool = False) -> list[int]:
    """The torchrun agents (launch.sh's ``python -m launcher.rank.agent``) and, unless ``agents_only``, the ranks
    (``-m launcher.rank``) among ``pids``: what keeps a run alive. A rank's helpers (Megatron's checkpoint writer,
    loader workers) can outlive it; ``python -m launcher`` ends them after the run (launcher/executor.py)."""
    names = {b"launcher.rank.agent", b"torch.distributed.run"} | (set() if agents_only else {b"launcher.rank"})
    return [pid for pid in pids if names & set(_cmdline(pid))]


def read_run(bundle: Path, live: Optional[dict] = None) -> RunInfo:
    """Everything ``runs`` and ``status`` show for one bundle."""
    info = RunInfo(name=bundle.name, path=str(bundle))
    job = _describe(bundle, info)
    _progress(bundle, info)
    submission = _json(bundle / "submission.json")
    if isinstance(submission, dict) and submission.get("job_id"):
        info.scheduler, info.job_id = "slurm", str(submission["job_id"])
        info.slurm_state = slurm_state(info.job_id)
        _slurm_state(bundle, info)
    else:
        live = live_processes() if live is None else live
        everything = sorted(live.get(os.path.normpath(str(bundle)), []))
        info.pids = training(everything)
        info.helpers = [p for p in everything if p not in info.pids]
        _local_state(bundle, info)
    if job is not None:
        from launcher.core.checkpoint.directory import checkpoint_dir, latest_checkpoint

        newest = latest_checkpoint(checkpoint_dir(job.checkpoint.dir, bundle))
        info.checkpoint = str(newest) if newest is not None else None
    if job is not None:
        _post(bundle, job, info)
    if info.state in ("running", "stopping") and info.ms_per_step and info.total and info.step is not None:
        info.eta_s = round(info.ms_per_step / 1e3 * max(0, info.total - info.step), 1)
    return info


def _describe(bundle: Path, info: RunInfo):
    """Model, recipe, layout and total steps from config.yaml (the core's one derivation); the job, or None."""
    meta = _json(bundle / "meta.json") or {}
    info.created = meta.get("created_utc")
    recipes = [a.split("=", 1)[1] for a in meta.get("argv", []) if isinstance(a, str) and a.startswith("recipe=")]
    try:
        from launcher.core import derive, load_job

        job = load_job(bundle / "config.yaml")
        lay = derive(job)
    except Exception:  # noqa: BLE001 - a bundle of another launcher version: show what can be read
        return None
    info.model, info.recipe, info.total, info.world = job.model.name, recipes[-1] if recipes else _default_recipe(), \
        lay.steps, lay.world
    parts = [f"TP{lay.tp}", f"PP{lay.pp}"] + [f"{k}{v}" for k, v in (("VPP", lay.vpp), ("CP", lay.cp),
                                                                       ("EP", lay.ep)) if v and v > 1]
    info.layout = " ".join(parts + [f"DP{lay.dp}"])
    return job


def _default_recipe() -> str:
    """The recipe of a launch that named none: the one recipes/config.yaml's defaults list chooses."""
    from launcher import RECIPES_DIR

    defaults = read_text(RECIPES_DIR / "config.yaml", 100000) or ""
    found = re.search(r"^\s*-\s*recipe:\s*(\S+)", defaults, re.MULTILINE)
    return found.group(1) if found else "?"


def _progress(bundle: Path, info: RunInfo) -> None:
    """Attempts (progress.json), the last step line of rank 0's log (loss, ms/step) and the step reached."""
    data = _json(bundle / "progress.json")
    attempts = data.get("attempts") if isinstance(data, dict) else None
    info.attempts = [a for a in attempts if isinstance(a, dict)] if isinstance(attempts, list) else []
    lines = STEP_LINE.findall(_tail(bundle / "logs" / "rank-0.log"))
    if lines:
        info.loss = float(lines[-1][1])
        recent = sorted(float(ms) for _, _, ms in lines[-5:])
        info.ms_per_step = recent[len(recent) // 2]
    reached = [a.get("reached") for a in info.attempts if isinstance(a.get("reached"), int)]
    info.step = max(reached + [int(lines[-1][0])] if lines else reached, default=None)
    done = read_text(bundle / "DONE")
    if done and done.isdigit():
        info.step = int(done)


def _ended(bundle: Path, info: RunInfo) -> bool:
    """The bundle's final markers (launch.sh removes them when a launch starts): set state and reason."""
    failed, stopped = read_text(bundle / "FAILED"), read_text(bundle / "STOPPED")
    if (bundle / "DONE").is_file():
        info.state = "done"
    elif failed:
        info.state, info.reason = "failed", failed.splitlines()[0]
    elif stopped:
        info.state, info.reason = "stopped", stopped.splitlines()[0]
    else:
        return False
    return True


def _local_state(bundle: Path, info: RunInfo) -> None:
    if _ended(bundle, info):
        if info.pids:
            info.reason = f"{info.reason or info.state}; {len(info.pids)} process(es) still ending"
    elif info.pids:
        info.state = "stopping" if (bundle / "STOP").exists() else "running" if info.attempts else "starting"
    elif info.attempts or (bundle / "logs" / "local.log").is_file():
        info.state, info.reason = "failed", _crash_reason(bundle, info)
    if info.helpers and not info.pids:
        left = f"{len(info.helpers)} helper process(es) of its ranks still alive ({' '.join(map(str, info.helpers))})"
        info.reason = f"{info.reason}; {left}" if info.reason else left


def _crash_reason(bundle: Path, info: RunInfo) -> str:
    """Why a run ended without DONE, FAILED or STOPPED: the first Python error of its last attempt, else the
    launch's own final line."""
    last = info.attempts[-1] if info.attempts else {}
    error = last.get("error")
    if not error and last.get("id"):
        error = read_text(bundle / "attempts" / f"error-{last['id'].replace(', ', '-').replace(' ', '')}", 500)
    if error:
        return error.splitlines()[0]
    finals = [line for line in _tail(bundle / "logs" / "local.log", 8192).splitlines()
              if line.startswith("launcher: ")]
    if finals:
        return finals[-1].removeprefix("launcher: ")
    return "ended without DONE, FAILED or STOPPED and no process left (killed?); see logs/rank-*.log"


def slurm_state(job_id: str) -> Optional[str]:
    """The job's state from squeue, else sacct (needs slurmdbd), else scontrol (recent jobs); None if unknown."""
    for cmd in (["squeue", "-h", "-j", job_id, "-o", "%T"], ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"],
                ["scontrol", "show", "job", "-o", job_id]):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode != 0 or not out.stdout.strip():
            continue
        if cmd[0] == "scontrol":
            found = re.search(r"\bJobState=(\S+)", out.stdout)
            return found.group(1) if found else None
        return out.stdout.split()[0].split("+")[0]  # sacct: "CANCELLED by 0"
    return None


def _slurm_state(bundle: Path, info: RunInfo) -> None:
    state = info.slurm_state
    if state in SLURM_PENDING:
        info.state = "pending"
    elif state in SLURM_ACTIVE:
        info.state = "stopping" if (bundle / "STOP").exists() else "running"
    elif not _ended(bundle, info):
        if state is None:
            info.state, info.reason = "unknown", f"Slurm no longer knows job {info.job_id} (no sacct) and the " \
                                                 "bundle has no DONE, FAILED or STOPPED"
        else:
            info.state = "cancelled" if state == "CANCELLED" else "failed"
            info.reason = f"slurm: {state}" + (f"; {_crash_reason(bundle, info)}" if info.attempts else "")


def _post(bundle: Path, job, info: RunInfo) -> None:
    """The post steps' state (BUNDLE/post.json, written by launcher/hf/post.py; post_submission.json, by job.sbatch
    when it submits them) and every kept checkpoint's eval.json."""
    from launcher.core.checkpoint.directory import checkpoint_dir, complete_checkpoints

    for path, manifest in reversed(complete_checkpoints(checkpoint_dir(job.checkpoint.dir, bundle))):
        result = _json(path / "eval.json")
        hf = path / "hf" / "config.json"
        if isinstance(result, dict) or hf.is_file():
            info.evals.append({**(result if isinstance(result, dict) else {"iteration": manifest.get("step")}),
                               "path": str(path), "hf": str(hf.parent) if hf.is_file() else None})
    scored = [e for e in info.evals if isinstance(e.get("perplexity"), (int, float))]
    info.score = float(scored[-1]["perplexity"]) if scored else None
    p = job.post
    if not (p.export_hf or p.eval or p.lm_eval_tasks):
        return
    state, submitted = _json(bundle / "post.json"), _json(bundle / "post_submission.json")
    if isinstance(submitted, dict) and submitted.get("job_id"):
        info.post_job_id = str(submitted["job_id"])
    said = state.get("state") if isinstance(state, dict) else None
    if said in ("done", "failed"):
        info.post, info.post_reason = said, state.get("reason")
    elif info.post_job_id:
        slurm = slurm_state(info.post_job_id)
        if slurm in SLURM_PENDING or slurm in SLURM_ACTIVE:
            info.post = "pending" if slurm in SLURM_PENDING else "running"
        else:
            info.post, info.post_reason = "failed", f"post job {info.post_job_id} ended without a result " \
                                                    f"(slurm: {slurm or 'forgotten'}); see logs/post-{info.post_job_id}.out"
    elif said == "running":
        alive = state.get("host") != os.uname().nodename or _alive_pid(state.get("pid"))
        info.post, info.post_reason = ("running", None) if alive else \
            ("failed", "ended without a result (killed?); see logs/post.log")
    elif info.state == "done":
        info.post = "waiting"  # a local run starts post.sh right after; job.sbatch submits post.sbatch
    else:
        info.post = "waiting" if info.state in ACTIVE else "not run"


def _alive_pid(pid) -> bool:
    try:
        os.kill(int(pid), 0)
        return True
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
