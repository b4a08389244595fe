"""Stopping in time for a Slurm time limit: the checkpoint-and-stop lead, from measured save times.

A run that stops for its time limit has to finish the step in flight, save a checkpoint and exit before Slurm
kills it; otherwise everything since the previous checkpoint is lost. The time that needs is

    needed_s = slurm.signal_save_factor x save_s + step_s + slurm.signal_margin_s

(the factor covers a save slower than the last one: a busier file system, a larger optimizer state; the margin
covers teardown and the job script's requeue). With ``checkpoint.async_save`` a save may still be in flight when
the stop begins; the stop save waits for it to be published first (launcher/rank/entry.py, as Megatron-LM's
``maybe_finalize_async_save(blocking=True)`` before its exit save), so one more factor x save_s is needed: always at
render (the signal may come just after a save began), on the ranks while one is in flight. It is used in two places, because the sbatch ``--signal`` lead is
rendered once and a requeue reruns the same script:

- **render** (login node, ``lead_for_render``): ``#SBATCH --signal=B:USR1@<lead>``. An explicit
  ``slurm.signal_lead_s`` is used as given. Null derives it: save_s is the measured save time of the newest
  complete checkpoint in ``checkpoint.dir`` (``iter_N/launcher.json``, ``save_seconds``: this run on this file
  system, so it wins), else the planner's estimate (checkpoint bytes / (nodes x
  ``cluster.checkpoint_write_gbps``)); step_s is the planned step time. The derived lead is never below ``FLOOR_S`` (or a quarter of the time limit, if shorter), the old
  fixed default, so fast saves keep the familiar lead and slow ones get a longer one.
- **the ranks** (``StopGuard``, every attempt, requeues included): the job script reads the job's end time
  from Slurm at each start (``squeue -o %e``, exported as ``LAUNCHER_JOB_END``); after every step the ranks
  stop (checkpoint, exit, requeue) once the time left is below needed_s computed with *this run's* latest
  measured save time and its slowest recent step. This catches a lead that turned out too short (saves got
  slower since render, or no checkpoint had been measured yet) without waiting for the signal.

The checkpoint's size and save-time estimates and the measured save live with the checkpoint directory
(``launcher/core/checkpoint/directory.py``). Torch-free: imported by the login node (render) and the rank wing.
"""
from __future__ import annotations

import math
import os
import time
from collections import deque
from pathlib import Path
from typing import Optional

from launcher.core.checkpoint.directory import estimated_save_s, measured_save_s

FLOOR_S = 300
"""The derived lead is at least this (capped at a quarter of the time limit): the fixed default it replaces."""
JOB_END_ENV = "LAUNCHER_JOB_END"
"""Epoch seconds of the Slurm job's end time, exported by job.sbatch at each start of the job."""
LEAD_ENV = "LAUNCHER_SIGNAL_LEAD_S"
"""The --signal lead job.sbatch was rendered with (so the ranks can say when it is too short)."""


def needed_s(save_s: float, step_s: float, *, factor: float, margin_s: float, in_flight: bool = False) -> float:
    """Seconds before the time limit at which a stop must begin: factor x save + one step + margin, and factor x
    save more while an asynchronous save is in flight (the stop save waits for it)."""
    return factor * max(save_s, 0.0) * (2 if in_flight else 1) + max(step_s, 0.0) + margin_s


def derived_lead_s(*, limit_s: int, save_s: float, step_s: float, factor: float, margin_s: float,
                   in_flight: bool = False) -> int:
    """The --signal lead for a null slurm.signal_lead_s: needed_s rounded up, at least min(FLOOR_S, limit/4)."""
    need = math.ceil(needed_s(save_s, step_s, factor=factor, margin_s=margin_s, in_flight=in_flight))
    return max(need, min(FLOOR_S, limit_s // 4))


def shutdown_timeout_s(lead_s: int) -> int:
    """torchrun's ``--shutdown-timeout``: how long it waits for its ranks after passing a stop signal on (Ctrl-C,
    SIGTERM, SIGHUP) before it SIGKILLs them. Its default, 30 s, killed ranks that were saving their stop
    checkpoint (a 4-rank CPU run at load 40-60: step 4 finished, the save did not) -- and a large model's save takes
    minutes. A stop gets the time the signal lead allows one (``needed_s`` and its floor), at least ``FLOOR_S``:
    a rank that cannot reach a step boundary still exits after its own grace (``launcher.rank.signals``), a second
    Ctrl-C ends the run at once, and under Slurm ``KillWait`` bounds a SIGTERM stop whatever this says."""
    return max(FLOOR_S, int(lead_s))


def lead_for_render(job, limit_s: int, plan: Optional[dict] = None, ckpt_dir: Optional[Path] = None) -> dict:
    """The lead to render and what it rests on (kept in the bundle's meta.json). ``plan`` is the planner's
    to_dict() (params, step time), ``ckpt_dir`` the checkpoint dir to look for a measured save in."""
    s = job.slurm
    if s.signal_lead_s is not None:
        return {"seconds": int(s.signal_lead_s), "source": "slurm.signal_lead_s (explicit)"}
    step_s, save_s, estimate, measured = step_and_save_s(job, plan, ckpt_dir)
    in_flight = bool(job.checkpoint.async_save)  # a stop may find an async save in flight: it waits for it
    lead = derived_lead_s(limit_s=limit_s, save_s=save_s, step_s=step_s, factor=s.signal_save_factor,
                          margin_s=s.signal_margin_s, in_flight=in_flight)
    return {"seconds": lead, "source": "derived", "save_s": round(save_s, 3), "estimated_save_s": round(estimate, 3),
            "measured_save_s": measured[0] if measured else None,
            "measured_in": str(measured[1]) if measured else None, "step_s": round(step_s, 3),
            "factor": s.signal_save_factor, "margin_s": s.signal_margin_s,
            "floor_s": min(FLOOR_S, limit_s // 4), **({"async_save_in_flight": True} if in_flight else {})}


def step_and_save_s(job, plan: Optional[dict] = None, ckpt_dir: Optional[Path] = None) -> tuple:
    """(planned step s, save s, the planner's save estimate, the measured save as (seconds, checkpoint) or None):
    the save is the newest checkpoint's measured one in ``ckpt_dir`` (this run on this file system) where there
    is one, else the estimate from the planned parameter count and ``cluster.checkpoint_write_gbps``."""
    params = _plan_number(plan, "params", "total")
    step_s = _plan_number(plan, "step", "step_s") or 0.0
    estimate = (estimated_save_s(params, job.precision.dtype, nodes=job.nodes,
                                 write_gbps=job.cluster.checkpoint_write_gbps) if params else 0.0)
    measured = measured_save_s(ckpt_dir) if ckpt_dir is not None else None
    return step_s, (measured[0] if measured else estimate), estimate, measured


def _plan_number(plan: Optional[dict], key: str, sub: str) -> Optional[float]:
    value = (plan or {}).get(key)
    value = value.get(sub) if isinstance(value, dict) else value
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else None


def job_end_from_env(environ=None) -> Optional[float]:
    """The Slurm job's end time (epoch seconds) that job.sbatch exported, or None (local runs, unknown)."""
    raw = (environ if environ is not None else os.environ).get(JOB_END_ENV, "").strip()
    try:
        end = float(raw)
    except ValueError:
        return None
    return end if math.isfinite(end) and end > 0 else None


TIME_LIMIT_REASON = "the Slurm time limit is"
"""How ``StopGuard.reason`` begins (the ranks' stop-reason reduction recognises it: launcher/rank/loop.py)."""


class StopGuard:
    """Rank side: stop for a checkpoint once the job's time left is below needed_s, with this run's own latest
    save time (the resumed checkpoint's, then each new save's) and its slowest recent step (the last 20).
    Before any save was measured, ``save_s`` is the caller's estimate."""

    def __init__(self, job_end: Optional[float], *, save_s: float, factor: float, margin_s: float,
                 clock=time.time):
        self.job_end, self.save_s, self.factor, self.margin_s = job_end, save_s, factor, margin_s
        self.steps: deque = deque(maxlen=20)
        self.clock = clock
        self.in_flight = False
        """An asynchronous save is being written (the entry sets it each step): a stop waits for it first."""

    def step_took(self, seconds: float) -> None:
        self.steps.append(seconds)

    def saved(self, seconds: float) -> None:
        self.save_s = seconds

    def needed(self) -> float:
        return needed_s(self.save_s, max(self.steps, default=0.0), factor=self.factor, margin_s=self.margin_s,
                        in_flight=self.in_flight)

    def reason(self) -> Optional[str]:
        """Why to stop now, or None (also None when the job's end time is unknown)."""
        if self.job_end is None:
            return None
        left, need = self.job_end - self.clock(), self.needed()
        if left >= need:
            return None
        return (f"{TIME_LIMIT_REASON} {max(left, 0):.0f} s away, less than {self.factor:g} x the last save "
                f"({self.save_s:.1f} s) + a step ({max(self.steps, default=0.0):.1f} s) + {self.margin_s:g} s")
