"""The no-progress rule: a crash that repeats at the same step stops the run instead of burning every restart.

Each attempt at a bundle (a torchrun restart, a Slurm requeue, a second ``bash launch.sh``) is one record in
``BUNDLE/progress.json``, kept by rank 0 (the bundle is on storage every node sees)::

    {"attempts": [{"id": "requeue 0, restart 1", "resumed": 40, "reached": 49, "saved": null, "outcome": null,
                   "error": "rank 3 at step 50: OSError: ..."}, ...]}

``launch``: which launch it belongs to (``LAUNCHER_LAUNCH_ID`` from launch.sh: a Slurm job with all its requeues,
or one local run with its torchrun restarts; only attempts of the current launch are compared, so running the
bundle again after a fix starts afresh); ``resumed``: the step it resumed from (0: from the start; null: it died before resuming); ``reached``: the last
step it completed (written after every step); ``saved``: the newest checkpoint it wrote; ``outcome``: ``done`` or
``stopped`` once it ended cleanly (null: it crashed or was killed). The first Python error any rank of an attempt
raises is kept beside it (``BUNDLE/attempts/error-<id>``), since the failing rank is often not rank 0.

Before an attempt builds anything, every rank reads the records: if the last attempt crashed at the same step as
the one before it and saved no checkpoint on the way, a third would resume from the same place and crash there
too, so this one stops with one line naming the step and the last error, and writes ``FAILED`` (torchrun's remaining restarts then stop at once;
the job script requeues no failed run). ``cluster.max_restarts`` and ``slurm.max_requeues`` bound the rest.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional

PROGRESS = "progress.json"
ERRORS = "attempts"
STEP: list = [None]
"""This rank's last completed step (None before training), for the error record."""


LAUNCH_ENV = "LAUNCHER_LAUNCH_ID"
"""Set by launch.sh: one Slurm job (all its requeues), or one local run of the bundle (all its torchrun restarts)."""


def launch_id() -> str:
    return os.environ.get(LAUNCH_ENV, "")


def attempt_id() -> str:
    """This attempt's name from Slurm's and torchrun's restart counters (the same on every rank)."""
    return (f"requeue {os.environ.get('SLURM_RESTART_COUNT') or 0}, "
            f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT') or 0}")


def _error_file(bundle: Path, attempt: str) -> Path:
    return Path(bundle) / ERRORS / f"error-{attempt.replace(', ', '-').replace(' ', '')}"


def read(bundle: Path) -> list:
    try:
        data = json.loads((Path(bundle) / PROGRESS).read_text())
    except (OSError, ValueError):
        return []
    attempts = data.get("attempts") if isinstance(data, dict) else None
    return [a for a in attempts if isinstance(a, dict)] if isinstance(attempts, list) else []


def _write(bundle: Path, attempts: list) -> None:
    path = Path(bundle) / PROGRESS
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{PROGRESS}.", dir=path.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump({"attempts": attempts}, fh, indent=1)
        os.replace(tmp, path)
    except OSError:  # bookkeeping must never be what stops a run
        pass


def _where(step) -> str:
    return "the start" if not step else f"the checkpoint of step {step}"


def verdict(attempts: list, last_error: Optional[str] = None, launch: Optional[str] = None) -> Optional[str]:
    """The no-progress line when the last attempt crashed at the same step as the one before it and saved no
    checkpoint on the way (a third attempt would resume from the same place and crash there too), else None.
    With ``launch``, only that launch's attempts count (running the bundle again starts afresh)."""
    if launch is not None:
        attempts = [a for a in attempts if a.get("launch", "") == launch]
    if len(attempts) < 2:
        return None
    before, last = attempts[-2], attempts[-1]
    if before.get("outcome") or last.get("outcome") or last.get("saved") is not None \
            or before.get("reached") != last.get("reached"):
        return None
    error = last.get("error") or last_error or ("no Python error: a rank was killed or crashed in native code; "
                                                "see logs/rank-*.log")
    resumed, reached = last.get("resumed"), last.get("reached")
    if reached is None:
        what = "before their first step (while starting, loading or building)"
    else:
        what = f"at step {reached + 1}, the second after resuming from {_where(resumed)} and saving no checkpoint"
    return (f"no progress: attempts '{before.get('id')}' and '{last.get('id')}' both failed {what} (last error: "
            f"{error}); not restarting or requeueing: fix the cause, then run the bundle again (it resumes from "
            f"{_where(resumed) if resumed is not None else 'its newest checkpoint'})")


class Attempt:
    """Rank 0's record of this attempt (other ranks keep only their error)."""

    def __init__(self, bundle: Path, rank: int):
        self.bundle, self.rank, self.id = Path(bundle), rank, attempt_id()
        self.record: Optional[dict] = None

    def start(self) -> None:
        """Rank 0, once the checkpoint dir is locked: a new record; the previous attempt's error joins its own."""
        if self.rank != 0:
            return
        attempts = read(self.bundle)
        if attempts and not attempts[-1].get("outcome") and not attempts[-1].get("error"):
            attempts[-1]["error"] = _read_error(self.bundle, attempts[-1].get("id", ""))
        _error_file(self.bundle, self.id).unlink(missing_ok=True)
        self.record = {"id": self.id, "launch": launch_id(), "resumed": None, "reached": None, "saved": None,
                       "outcome": None}
        self._attempts = attempts + [self.record]
        _write(self.bundle, self._attempts)

    def update(self, **fields) -> None:
        if self.record is not None and any(self.record.get(k) != v for k, v in fields.items()):
            self.record.update(fields)
            _write(self.bundle, self._attempts)


def _read_error(bundle: Path, attempt: str) -> Optional[str]:
    try:
        return _error_file(bundle, attempt).read_text().strip()[:500] or None
    except OSError:
        return None


def record_error(bundle: Path, rank: int, step: Optional[int], exc: BaseException) -> None:
    """Any rank, on a Python error: keep the attempt's first error (later ones are usually its echo on the other
    ranks: a closed connection, a timed-out collective)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    where = f" at step {step + 1}" if step is not None else ""
    path = _error_file(bundle, attempt_id())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"rank {rank}{where}: {type(exc).__name__}: {text}"[:500] + "\n")
    except OSError:
        pass


def check(bundle: Path) -> Optional[str]:
    """Every rank, before anything is built: the no-progress line, or None."""
    attempts = [a for a in read(bundle) if a.get("launch", "") == launch_id()]
    last = attempts[-1].get("id", "") if attempts else ""
    return verdict(attempts, _read_error(bundle, last) if last else None)
