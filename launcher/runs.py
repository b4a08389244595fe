"""After ``action=run`` or ``action=submit`` a user has a run bundle: ``python -m launcher runs|status|logs|cancel``.

- ``runs [DIR] [--json]``: one line per bundle under DIR (default: the schema's ``output_dir``, ``runs``).
- ``status RUN [--json]``: one run in detail; a failed run's one-line reason.
- ``logs RUN [--rank N] [--follow]``: a rank's log (``logs/rank-N.log``); ``--follow`` tails it until the run ends.
- ``cancel RUN``: a stop checkpoint first, then the scheduler's cancel, and a check that the run ended.

``status``, ``logs`` and ``cancel`` also take the bundle of an ``import-hf``/``export-hf --slurm`` job
(launcher/slurm_tool.py): one step, its state from Slurm and the ``EXIT_CODE`` its script leaves, its one log.

What a bundle says is read by launcher/run_state.py. Login-node code: no torch, no megatron, no rank wing; each
command answers in about a second (``logs --follow`` and ``cancel`` then wait for the run).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from launcher.problems import EXIT_USAGE
from launcher.run_state import (ACTIVE, SLURM_ACTIVE, SLURM_PENDING, RunInfo, live_processes, read_run, read_text,
                                slurm_state, training)

COMMANDS = ("runs", "status", "logs", "cancel")
USAGE = {
    "runs": "python -m launcher runs [DIR] [--json]",
    "status": "python -m launcher status RUN [--json]",
    "logs": "python -m launcher logs RUN [--rank N] [--follow]",
    "cancel": "python -m launcher cancel RUN",
}
POLL_S = 0.5


class UsageError(Exception):
    """Bad input: one line, exit 2."""


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


def is_tool_bundle(path: Path) -> bool:
    """A conversion submitted with ``--slurm`` (launcher/slurm_tool.py): ``status`` and ``logs`` show it; ``runs``
    lists training runs only."""
    return (path / "tool.json").is_file() and (path / "job.sbatch").is_file()


BUNDLE_NAME = re.compile(r"^(?P<job>.+)-(?P<stamp>\d{8}-\d{6})(?:-(?P<n>\d+))?$")
"""render.py's bundle names: <job name>-<UTC stamp>[-n] (n: the second launch of the same second)."""


def _oldest_first(path: Path) -> tuple:
    named = BUNDLE_NAME.match(path.name)
    return (named["stamp"], int(named["n"] or 1), path.name) if named else ("", 0, path.name)


def bundles_under(directory: Path) -> list[Path]:
    """The run bundles directly under ``directory``, oldest first (by the UTC stamp in their names)."""
    try:
        return sorted((p for p in directory.iterdir() if p.is_dir() and is_bundle(p)), key=_oldest_first)
    except OSError:
        return []


def resolve(run: str) -> Path:
    """RUN as a path to a bundle, or a bundle name under the default dir, or a job name there (its newest run)."""
    path, base = Path(run), Path(default_dir())
    if path.exists():
        if not path.is_dir() or not (is_bundle(path) or is_tool_bundle(path)):
            raise UsageError(f"{run} is not a run bundle (no config.yaml and launch.sh): try python -m launcher "
                             f"runs {_holding_bundles(path)}")
        return _abs(path)
    if (base / run).is_dir() and (is_bundle(base / run) or is_tool_bundle(base / run)):
        return _abs(base / run)
    named = [p for p in bundles_under(base) if (BUNDLE_NAME.match(p.name) or {"job": None})["job"] == run]
    if named:
        return _abs(named[-1])
    known = [p.name for p in bundles_under(base)]
    hint = f"runs there: {', '.join(known[-3:])}" if known else f"no runs under {base}/"
    raise UsageError(f"no run {run}: not a path, nor a bundle or job name under {base}/ ({hint}); "
                     f"try python -m launcher runs")


def _abs(path: Path) -> Path:
    """Absolute, symbolic links resolved: the path render.py writes the bundle at and launch.sh exports as
    ``LAUNCHER_BUNDLE``."""
    return Path(path).resolve()


def _holding_bundles(path: Path) -> str:
    """``path`` or the folder in it that holds bundles (to list them), else the default dir."""
    for folder in ([path] + sorted(p for p in path.iterdir() if p.is_dir())) if path.is_dir() else []:
        if bundles_under(folder):
            return str(folder)
    return default_dir()


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
    bundle = _one_run("status", positional)
    if is_tool_bundle(bundle):
        tool = read_tool(bundle)
        print(json.dumps(tool, indent=1) if options.get("--json") else tool_detail(tool))
        return 0
    info = read_run(bundle)
    print(json.dumps(asdict(info), indent=1) if options.get("--json") else detail(info))
    return 0


def read_tool(bundle: Path) -> dict:
    """A ``--slurm`` conversion's state: pending/running (Slurm's word), done or failed (the step's EXIT_CODE,
    written by job.sbatch), or what Slurm says of a job that ended without one (cancelled, timeout, ...)."""
    tool = json.loads((bundle / "tool.json").read_text())
    submitted = _json_file(bundle / "submission.json")
    job_id = str(submitted["job_id"]) if isinstance(submitted, dict) and submitted.get("job_id") else None
    said = slurm_state(job_id) if job_id else None
    code, reason = read_text(bundle / "EXIT_CODE"), None
    log = bundle / "logs" / f"slurm-{job_id}.out"
    if code is not None and code.strip().lstrip("-").isdigit():
        state = "done" if int(code) == 0 else "failed"
        if state == "failed":
            errors = [line for line in _tail_lines(log) if line.startswith("error: ")]
            reason = f"exit code {code}" + (f": {errors[-1].removeprefix('error: ')}" if errors else "")
    elif job_id is None:
        state = "rendered"
    elif said in SLURM_PENDING:
        state = "pending"
    elif said in SLURM_ACTIVE:
        state = "running"
    else:
        state = "cancelled" if said == "CANCELLED" else "failed"
        reason = f"slurm: {said or 'no longer known'}, no exit code written"
    return {"name": bundle.name, "path": str(bundle), "command": tool.get("command"), "argv": tool.get("argv"),
            "job_id": job_id, "slurm_state": said, "state": state, "reason": reason, "mem_mb": tool.get("mem_mb"),
            "bound": tool.get("bound"), "slack": tool.get("slack"), "log": str(log) if job_id else None}


def tool_detail(tool: dict) -> str:
    return "\n".join([f"run:        {tool['name']} ({tool['command']} --slurm)", f"bundle:     {tool['path']}",
                      "command:    python -m launcher " + " ".join(tool.get("argv") or []),
                      "scheduler:  slurm" + (f" job {tool['job_id']} ({tool['slurm_state'] or 'unknown to Slurm'})"
                                             if tool["job_id"] else " (not submitted)"),
                      f"state:      {tool['state']}" + (f": {tool['reason']}" if tool["reason"] else ""),
                      f"memory:     --mem={tool['mem_mb']}M ({tool['bound']} + {tool['slack'] or 0:.0%})",
                      f"log:        {tool['log'] or '-'}"])


def _json_file(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tail_lines(path: Path, size: int = 65536) -> list[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - size))
            return fh.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _step(info: RunInfo) -> str:
    return f"{info.step if info.step is not None else '-'}/{info.total if info.total is not None else '?'}"


def _state(info: RunInfo) -> str:
    """The state, and Slurm's own word for it where that says more (COMPLETING, SUSPENDED, REQUEUED, ...)."""
    said = info.slurm_state and info.state in ACTIVE and info.slurm_state not in ("RUNNING", "PENDING")
    return info.state + (f" ({info.slurm_state})" if said else "")


def table(infos: list[RunInfo]) -> str:
    header = ("NAME", "MODEL", "LAYOUT", "SCHEDULER", "STATE", "STEP", "LOSS", "ETA", "ATTEMPTS", "CHECKPOINT", "PPL")
    rows = [header] + [(i.name, i.model, i.layout, i.scheduler + (f" {i.job_id}" if i.job_id else ""), _state(i),
                        _step(i), f"{i.loss:.4f}" if i.loss is not None else "-", _duration(i.eta_s),
                        str(len(i.attempts)), Path(i.checkpoint).name if i.checkpoint else "-", _score(i))
                       for i in infos]
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _score(info: RunInfo) -> str:
    """The PPL column: the newest evaluated checkpoint's perplexity (post.eval), else where the post steps are."""
    if info.score is not None:
        return f"{info.score:.2f}"
    return {None: "-", "done": "-", "not run": "-"}.get(info.post, f"post:{info.post}")


def _post_lines(info: RunInfo) -> list[str]:
    lines = []
    if info.post is not None:
        lines.append(f"post:       {info.post}" + (f" (job {info.post_job_id})" if info.post_job_id else "")
                     + (f": {info.post_reason}" if info.post_reason else ""))
    for e in info.evals:
        said = [f"perplexity {e['perplexity']:.2f} (loss {e['loss']:.4f}, {e['tokens']} tokens)"] \
            if isinstance(e.get("perplexity"), (int, float)) else []
        said += [f"hf {e['hf']}"] if e.get("hf") else []
        lines.append(f"  {Path(e['path']).name}: {', '.join(said)}")
    return lines


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
    lines += _post_lines(info)
    if info.pids:
        lines.append(f"processes:  {' '.join(map(str, info.pids))}")
    for n, a in enumerate(info.attempts, 1):
        lines.append(f"attempt {n}:  {a.get('id')}: resumed from {a.get('resumed')}, reached {a.get('reached')}, "
                     f"saved {a.get('saved')}, {a.get('outcome') or 'no clean end'}"
                     + (f"; {a['error']}" if a.get("error") else ""))
    if info.state in ("failed", "stopped", "cancelled"):  # launch.sh and job.sbatch resume the newest checkpoint
        again = f"sbatch {info.path}/job.sbatch" if info.scheduler == "slurm" else f"bash {info.path}/launch.sh"
        lines.append(f"run again:  {'after fixing the cause, ' if info.state == 'failed' else ''}{again} (it resumes "
                     "from its newest checkpoint, if any)")
    if info.state == "failed":
        lines.append(f"logs:       python -m launcher logs {info.path} --rank N")
    return "\n".join(lines)


# ---- logs --------------------------------------------------------------------------------------------------------

def _logs(argv: list[str]) -> int:
    positional, options = _options("logs", argv, flags=("--follow", "-f"), valued=("--rank",))
    bundle = _one_run("logs", positional)
    if is_tool_bundle(bundle):
        return _tool_logs(bundle, bool(options.get("--follow") or options.get("-f")))
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
        ended = not _still_active(bundle, info)  # asked before the copy: nothing written after it is lost
        offset = _copy(path, offset)
        if ended:
            break
        time.sleep(POLL_S)
    return 0


def _tool_logs(bundle: Path, follow: bool) -> int:
    """A ``--slurm`` conversion's one log (its single step's output, logs/slurm-<job id>.out)."""
    tool = read_tool(bundle)
    if tool["job_id"] is None:
        raise UsageError(f"{bundle.name} was never submitted: no log; submit it with sbatch {bundle}/job.sbatch")
    path = Path(tool["log"])
    offset = _copy(path, 0)
    while follow:
        ended = slurm_state(tool["job_id"]) not in SLURM_ACTIVE | SLURM_PENDING
        offset = _copy(path, offset)
        if ended:
            break
        time.sleep(POLL_S)
    return 0


def _still_active(bundle: Path, info: RunInfo) -> bool:
    """A cheap ``read_run(...).state in ACTIVE`` for polling: the job's Slurm state, or its live agents and ranks."""
    if info.job_id:
        return slurm_state(info.job_id) in SLURM_ACTIVE | SLURM_PENDING
    return bool(training(_alive(bundle)))


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
    if is_tool_bundle(bundle):  # one step with no checkpoint to save first: Slurm's cancel alone
        tool = read_tool(bundle)
        if tool["state"] not in ("pending", "running"):
            raise UsageError(f"{tool['name']} is {tool['state']}: nothing to cancel; see python -m launcher status "
                             f"{bundle}")
        _scancel(tool["job_id"])
        print(f"cancelled {tool['name']}: scancel {tool['job_id']}")
        return 0
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
    found = re.search(r"TORCH_ELASTIC_SHUTDOWN_TIMEOUT=(\d+)", read_text(bundle / "launch.sh", 100000) or "")
    return int(found.group(1)) if found else 300


def _cancel_local(bundle: Path, info: RunInfo) -> int:
    """SIGTERM to the launch's torchrun agent: it passes the signal to its ranks and waits (its shutdown timeout)
    while they finish the step in flight, all at the same step, save a checkpoint and exit (launcher/rank/
    signals.py). Not launch.sh's shell (bash dies of SIGTERM; ``python -m launcher`` would then end the group)."""
    targets = training(info.pids, agents_only=True) or info.pids  # no agent (a rank started by hand): the ranks
    sent = [pid for pid in targets if _kill(pid, signal.SIGTERM)]
    if not sent:
        raise UsageError(f"{info.name} ended while being cancelled; see python -m launcher status {bundle}")
    print(f"cancel: SIGTERM to the launch of {info.name} (pid {' '.join(map(str, sent))}): the ranks save a "
          "checkpoint at the next step boundary, then exit", flush=True)
    wait_s = _shutdown_timeout_s(bundle) + 60
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not training(_alive(bundle)):
            _end_helpers(bundle)
            return _confirm(bundle)
        time.sleep(POLL_S)
    print(f"error: {info.name} is still running {wait_s} s after SIGTERM; its processes: "
          f"{' '.join(map(str, training(_alive(bundle))))}", file=sys.stderr)
    return 1


def _alive(bundle: Path) -> list[int]:
    return live_processes().get(os.path.normpath(str(bundle)), [])


def _end_helpers(bundle: Path, wait_s: float = 15.0) -> None:
    """The ranks have ended; their helpers go with ``python -m launcher``'s cleanup (its 5 s grace), if it started
    them. One started by ``bash launch.sh`` has nobody to end it: SIGTERM, then SIGKILL, as that cleanup does."""
    deadline = time.monotonic() + wait_s
    while _alive(bundle) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if _alive(bundle):
        from launcher.executor import end_strays

        end_strays(str(bundle))


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
        # job.sbatch requeues a run that stopped cleanly before its time limit; CANCEL tells it this stop is a
        # cancel (left first: the script's requeue raced the scancel below and won under load, and the requeued
        # attempt trained on until this command's deadline)
        from launcher.render import atomic_write

        atomic_write(bundle / "CANCEL",
                     f"cancelled by python -m launcher cancel at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
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
