"""After ``action=run`` or ``action=submit`` a user has a run bundle: ``python -m launcher runs|status|logs|cancel``.

- ``runs [DIR] [--json]``: one line per bundle under DIR (default: the schema's ``output_dir``, ``runs``).
- ``status RUN [--json]``: one run in detail; a failed run's one-line reason.
- ``logs RUN [--rank N] [--follow]``: a rank's log (``logs/rank-N.log``); ``--follow`` tails it until the run ends.
- ``cancel RUN``: a stop checkpoint first, then the scheduler's cancel, and a check that the run ended.

Everything is read from the bundle itself, as the launch leaves it (launch.sh, launcher/rank/entry.py,
launcher/rank/progress.py): ``DONE`` (the last step), ``FAILED`` (one line: why), ``STOPPED`` (at which step, why),
``STOP`` (a stop asked for), ``progress.json`` (each attempt: resumed, reached, saved, outcome, first error),
``logs/rank-0.log`` (the step lines: loss, ms/step), the checkpoint dir's complete ``iter_N/launcher.json`` and,
for Slurm, ``submission.json`` (the job id sbatch gave). Whether a local run is alive is read from ``/proc``: every
process launch.sh starts inherits ``LAUNCHER_BUNDLE=<bundle>`` (env.sh), as launcher/executor.py's cleanup reads it.

Login-node code: no torch, no megatron, no rank wing; each command answers in about a second (``logs --follow``
and ``cancel`` then wait for the run).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from launcher.problems import EXIT_USAGE

COMMANDS = ("runs", "status", "logs", "cancel")
USAGE = {
    "runs": "python -m launcher runs [DIR] [--json]",
    "status": "python -m launcher status RUN [--json]",
    "logs": "python -m launcher logs RUN [--rank N] [--follow]",
    "cancel": "python -m launcher cancel RUN",
}
ACTIVE = ("pending", "starting", "running", "stopping")
"""States of a run that has not ended (cancel acts on these only)."""
STEP_LINE = re.compile(r"^step\s+(\d+) \| loss ([0-9.eE+-]+|nan|inf) \|.*?\| ([0-9.]+) ms/step", re.MULTILINE)
SLURM_PENDING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RESV_DEL_HOLD"}
SLURM_ACTIVE = {"RUNNING", "COMPLETING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "RESIZING", "STOPPED"}
POLL_S = 0.5


class UsageError(Exception):
    """Bad input: one line, exit 2."""


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
    created: Optional[str] = None


# ---- entry -------------------------------------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    """``argv``: the command and its arguments (``["status", "runs/smoke-..."]``)."""
    command, rest = argv[0], argv[1:]
    try:
        if any(a in ("-h", "--help") for a in rest):
            print(f"usage: {USAGE[command]}\n\n{_doc(command)}")
            return 0
        return {"runs": _runs, "status": _status, "logs": _logs, "cancel": _cancel}[command](rest)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _doc(command: str) -> str:
    return next(line.split(": ", 1)[1] for line in __doc__.splitlines() if line.startswith(f"- ``{command} "))


def _options(command: str, argv: list[str], flags: tuple = (), valued: tuple = ()) -> tuple[list, dict]:
    """Positional arguments and ``--flag`` / ``--name VALUE`` options; anything else is refused in one line."""
    positional, options, it = [], {}, iter(argv)
    for token in it:
        name, eq, value = token.partition("=")
        if name in flags and not eq:
            options[name] = True
        elif name in valued:
            value = value if eq else next(it, None)
            if value is None:
                raise UsageError(f"{name} needs a value: {USAGE[command]}")
            options[name] = value
        elif token.startswith("-"):
            raise UsageError(f"unknown option {token} for {command}: {USAGE[command]}")
        else:
            positional.append(token)
    return positional, options


def _one_run(command: str, positional: list) -> Path:
    if len(positional) != 1:
        got = "no RUN" if not positional else f"{len(positional)} arguments ({' '.join(positional)})"
        raise UsageError(f"{command} takes one RUN (a bundle path or a name under {default_dir()}/), got {got}: "
                         f"{USAGE[command]}")
    return resolve(positional[0])


# ---- finding bundles ---------------------------------------------------------------------------------------------

def default_dir() -> str:
    """Where bundles go unless ``output_dir=`` says otherwise: the schema's default (relative to the cwd)."""
    from launcher.schema import JobConfig

    return JobConfig.__dataclass_fields__["output_dir"].default


def is_bundle(path: Path) -> bool:
    return (path / "config.yaml").is_file() and (path / "launch.sh").is_file()


def bundles_under(directory: Path) -> list[Path]:
    """The run bundles directly under ``directory``, oldest first (by their UTC-stamped names)."""
    try:
        return sorted((p for p in directory.iterdir() if p.is_dir() and is_bundle(p)), key=lambda p: p.name)
    except OSError:
        return []


def resolve(run: str) -> Path:
    """RUN as a path to a bundle, or a bundle name under the default dir, or a job name there (its newest run)."""
    path, base = Path(run), Path(default_dir())
    if path.exists():
        if not path.is_dir() or not is_bundle(path):
            raise UsageError(f"{run} is not a run bundle (no config.yaml and launch.sh): try python -m launcher "
                             f"runs {_holding_bundles(path)}")
        return _abs(path)
    if (base / run).is_dir() and is_bundle(base / run):
        return _abs(base / run)
    named = [p for p in bundles_under(base) if p.name.startswith(f"{run}-")]
    if named:
        return _abs(named[-1])
    known = [p.name for p in bundles_under(base)]
    hint = f"runs there: {', '.join(known[-3:])}" if known else f"no runs under {base}/"
    raise UsageError(f"no run {run}: not a path, nor a bundle or job name under {base}/ ({hint}); "
                     f"try python -m launcher runs")


def _abs(path: Path) -> Path:
    """Absolute, symbolic links kept: the form launch.sh exports as ``LAUNCHER_BUNDLE`` (launcher/core/paths.py)."""
    from launcher.core.paths import absolute

    return Path(absolute(str(path)))


def _holding_bundles(path: Path) -> str:
    """``path`` or the folder in it that holds bundles (to list them), else the default dir."""
    for folder in ([path] + sorted(p for p in path.iterdir() if p.is_dir())) if path.is_dir() else []:
        if bundles_under(folder):
            return str(folder)
    return default_dir()


# ---- reading one bundle ------------------------------------------------------------------------------------------

def _text(path: Path, limit: int = 2000) -> Optional[str]:
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
        info.pids = sorted(live.get(os.path.normpath(str(bundle)), []))
        _local_state(bundle, info)
    if job is not None:
        from launcher.core.checkpoint_dir import checkpoint_dir, latest_checkpoint

        newest = latest_checkpoint(checkpoint_dir(job.checkpoint.dir, bundle))
        info.checkpoint = str(newest) if newest is not None else None
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

    found = re.search(r"^\s*-\s*recipe:\s*(\S+)", _text(RECIPES_DIR / "config.yaml", 100000) or "", re.MULTILINE)
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
    done = _text(bundle / "DONE")
    if done and done.isdigit():
        info.step = int(done)


def _ended(bundle: Path, info: RunInfo) -> bool:
    """The bundle's final markers (launch.sh removes them when a launch starts): set state and reason."""
    failed, stopped = _text(bundle / "FAILED"), _text(bundle / "STOPPED")
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
        return
    if info.pids:
        info.state = "stopping" if (bundle / "STOP").exists() else "running" if info.attempts else "starting"
    elif info.attempts or (bundle / "logs" / "local.log").is_file():
        info.state, info.reason = "failed", _crash_reason(bundle, info)


def _crash_reason(bundle: Path, info: RunInfo) -> str:
    """Why a run ended without DONE, FAILED or STOPPED: the first Python error of its last attempt, else the
    launch's own final line."""
    last = info.attempts[-1] if info.attempts else {}
    error = last.get("error")
    if not error and last.get("id"):
        error = _text(bundle / "attempts" / f"error-{last['id'].replace(', ', '-').replace(' ', '')}", 500)
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


# ---- runs, status ------------------------------------------------------------------------------------------------

def _runs(argv: list[str]) -> int:
    positional, options = _options("runs", argv, flags=("--json",))
    if len(positional) > 1:
        raise UsageError(f"runs takes at most one DIR, got {' '.join(positional)}: {USAGE['runs']}")
    directory = Path(positional[0] if positional else default_dir())
    if not directory.is_dir():
        raise UsageError(f"{directory}: no such directory; try python -m launcher runs {default_dir()} "
                         "(or the output_dir= your runs used)")
    if is_bundle(directory):
        raise UsageError(f"{directory} is one run bundle; try python -m launcher status {directory}")
    live = live_processes()
    infos = [read_run(b, live) for b in bundles_under(_abs(directory))]  # absolute, as LAUNCHER_BUNDLE is
    if options.get("--json"):
        print(json.dumps([asdict(i) for i in infos], indent=1))
    elif not infos:
        print(f"no run bundles under {directory}")
    else:
        print(table(infos))
    return 0


def _status(argv: list[str]) -> int:
    positional, options = _options("status", argv, flags=("--json",))
    info = read_run(_one_run("status", positional))
    print(json.dumps(asdict(info), indent=1) if options.get("--json") else detail(info))
    return 0


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _step(info: RunInfo) -> str:
    return f"{info.step if info.step is not None else '-'}/{info.total if info.total is not None else '?'}"


def _state(info: RunInfo) -> str:
    return info.state + (f" ({info.slurm_state})" if info.slurm_state and info.state in ACTIVE else "")


def table(infos: list[RunInfo]) -> str:
    header = ("NAME", "MODEL", "LAYOUT", "SCHEDULER", "STATE", "STEP", "LOSS", "ETA", "ATTEMPTS", "CHECKPOINT")
    rows = [header] + [(i.name, i.model, i.layout, i.scheduler + (f" {i.job_id}" if i.job_id else ""), _state(i),
                        _step(i), f"{i.loss:.4f}" if i.loss is not None else "-", _duration(i.eta_s),
                        str(len(i.attempts)), Path(i.checkpoint).name if i.checkpoint else "-") for i in infos]
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def detail(info: RunInfo) -> str:
    lines = [f"run:        {info.name}", f"bundle:     {info.path}",
             f"model:      {info.model} (recipe {info.recipe}), {info.layout}, {info.world or '?'} ranks",
             f"scheduler:  {info.scheduler}" + (f" job {info.job_id} ({info.slurm_state or 'unknown to Slurm'})"
                                                if info.job_id else ""),
             f"state:      {_state(info)}" + (f": {info.reason}" if info.reason else ""),
             f"step:       {_step(info)}" + (f", loss {info.loss:.4f}" if info.loss is not None else "")
             + (f", {info.ms_per_step:.0f} ms/step" if info.ms_per_step else "")
             + (f", ETA {_duration(info.eta_s)}" if info.eta_s is not None else ""),
             f"checkpoint: {info.checkpoint or 'none'}"]
    if info.pids:
        lines.append(f"processes:  {' '.join(map(str, info.pids))}")
    for n, a in enumerate(info.attempts, 1):
        lines.append(f"attempt {n}:  {a.get('id')}: resumed from {a.get('resumed')}, reached {a.get('reached')}, "
                     f"saved {a.get('saved')}, {a.get('outcome') or 'no clean end'}"
                     + (f"; {a['error']}" if a.get("error") else ""))
    if info.state == "failed":
        lines.append(f"logs:       python -m launcher logs {info.path} --rank N")
    return "\n".join(lines)


# ---- logs --------------------------------------------------------------------------------------------------------

def _logs(argv: list[str]) -> int:
    positional, options = _options("logs", argv, flags=("--follow", "-f"), valued=("--rank",))
    bundle = _one_run("logs", positional)
    info = read_run(bundle)
    rank = _rank(options.get("--rank", "0"), info)
    path = bundle / "logs" / f"rank-{rank}.log"
    follow = options.get("--follow") or options.get("-f")
    if not path.is_file() and not (follow and info.state in ACTIVE):
        have = sorted(p.name for p in (bundle / "logs").glob("rank-*.log")) if (bundle / "logs").is_dir() else []
        raise UsageError(f"no log for rank {rank} in {bundle}/logs/ (the run is {info.state}); "
                         + (f"logs there: {', '.join(have)}" if have else "try python -m launcher status "
                            f"{bundle}"))
    offset = _copy(path, 0)
    while follow:
        ended = read_run(bundle).state not in ACTIVE  # read before the copy: nothing written after it is lost
        offset = _copy(path, offset)
        if ended:
            break
        time.sleep(POLL_S)
    return 0


def _rank(raw: str, info: RunInfo) -> int:
    world = info.world
    if not raw.isdigit() or (world is not None and int(raw) >= world):
        hint = f"an integer from 0 to {world - 1}" if world else "a rank number (0, 1, ...)"
        raise UsageError(f"--rank {raw}: {hint} ({info.world or '?'} ranks); try --rank 0")
    return int(raw)


def _copy(path: Path, offset: int) -> int:
    """Write what ``path`` holds from ``offset`` to stdout; the new offset."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            while chunk := fh.read(65536):
                sys.stdout.buffer.write(chunk)
                offset += len(chunk)
    except FileNotFoundError:
        return offset
    sys.stdout.flush()
    return offset


# ---- cancel ------------------------------------------------------------------------------------------------------

def _cancel(argv: list[str]) -> int:
    positional, _ = _options("cancel", argv)
    bundle = _one_run("cancel", positional)
    info = read_run(bundle)
    if info.state == "rendered":
        raise UsageError(f"{info.name} was never started (rendered only): nothing to cancel; start it with "
                         f"bash {bundle}/launch.sh, or sbatch {bundle}/job.sbatch")
    if info.state not in ACTIVE:
        said = f"{info.state}" + (f": {info.reason}" if info.reason else f" at step {_step(info)}")
        raise UsageError(f"{info.name} has already ended ({said}): nothing to cancel; see python -m launcher "
                         f"status {bundle}")
    return _cancel_slurm(bundle, info) if info.scheduler == "slurm" else _cancel_local(bundle, info)


def _shutdown_timeout_s(bundle: Path) -> int:
    """How long torchrun waits for its ranks' stop checkpoint (launch.sh; the signal lead, at least 300 s)."""
    found = re.search(r"TORCH_ELASTIC_SHUTDOWN_TIMEOUT=(\d+)", _text(bundle / "launch.sh", 100000) or "")
    return int(found.group(1)) if found else 300


def _agents(pids: list[int]) -> list[int]:
    """The torchrun agents among a bundle's processes: the launch to signal (torchrun passes SIGTERM on)."""
    out = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"launcher.rank.agent" in cmdline or b"torch.distributed.run" in cmdline:
            out.append(pid)
    return out


def _cancel_local(bundle: Path, info: RunInfo) -> int:
    """SIGTERM to the launch's torchrun agent: it passes the signal to its ranks and waits (its shutdown timeout)
    while they finish the step in flight, all at the same step, save a checkpoint and exit (launcher/rank/
    signals.py). Not launch.sh's shell (bash dies of SIGTERM; ``python -m launcher`` would then end the group)."""
    targets = _agents(info.pids) or info.pids  # still starting (no agent yet): the processes there are
    sent = [pid for pid in targets if _kill(pid, signal.SIGTERM)]
    if not sent:
        raise UsageError(f"{info.name} ended while being cancelled; see python -m launcher status {bundle}")
    print(f"cancel: SIGTERM to the launch of {info.name} (pid {' '.join(map(str, sent))}): the ranks save a "
          "checkpoint at the next step boundary, then exit", flush=True)
    wait_s = _shutdown_timeout_s(bundle) + 60
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not live_processes().get(os.path.normpath(str(bundle))):
            return _confirm(bundle)
        time.sleep(POLL_S)
    print(f"error: {info.name} is still running {wait_s} s after SIGTERM; its processes: "
          f"{' '.join(map(str, live_processes().get(os.path.normpath(str(bundle)), [])))}", file=sys.stderr)
    return 1


def _kill(pid: int, sig) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _confirm(bundle: Path) -> int:
    """The run has ended: say where it stopped and which checkpoint holds it (0), or why there is none (1)."""
    after = read_run(bundle, live={})
    where = f"; checkpoint {after.checkpoint}" if after.checkpoint else "; no checkpoint"
    if after.state == "stopped":
        print(f"cancelled {after.name}: stopped {after.reason}{where}")
        return 0
    if after.state == "done":
        print(f"cancelled {after.name}: it finished first (step {_step(after)}){where}")
        return 0
    print(f"error: {after.name} ended without a stop checkpoint ({after.state}: {after.reason}){where}",
          file=sys.stderr)
    return 1


def _scancel(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["scancel", *args], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise UsageError("scancel not found: run cancel on the Slurm login node the job was submitted from") from None


def _cancel_slurm(bundle: Path, info: RunInfo) -> int:
    """A pending job is only cancelled. A running one first gets SIGTERM in its batch shell (``scancel --batch
    --signal=TERM``): job.sbatch's trap leaves STOP, every rank saves at the next step and exits, STOPPED is
    written. Then ``scancel`` ends the job, so its script's requeue of a stopped run does not start it again."""
    if info.state == "running" or info.state == "stopping":
        _scancel("--batch", "--signal=TERM", info.job_id)
        print(f"cancel: SIGTERM to job {info.job_id}'s batch shell (STOP): the ranks save a checkpoint at the next "
              "step boundary", flush=True)
        wait_s = _shutdown_timeout_s(bundle) + 60
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not (bundle / "STOPPED").is_file() and not (bundle / "DONE").is_file():
            if slurm_state(info.job_id) not in SLURM_ACTIVE:
                break
            time.sleep(POLL_S)
    _scancel(info.job_id)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and slurm_state(info.job_id) in SLURM_ACTIVE | SLURM_PENDING:
        time.sleep(POLL_S)
    if info.state == "pending":
        print(f"cancelled {info.name}: job {info.job_id} had not started ({slurm_state(info.job_id) or 'gone'})")
        return 0
    return _confirm(bundle)
