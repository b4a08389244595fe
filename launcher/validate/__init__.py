"""Validate a composed job, section by section, before anything is written or submitted.

The entry point: ``validate(job)`` returns every Problem (field, value, rule, alternative) of every section at
once, each alternative checked. The rules mirror Megatron-Core's own asserts (parallel_state, TransformerConfig,
the pipeline schedules, Megatron-LM's ``megatron/training/arguments.py``) so that a job that passes here does
not die at step 0 on 512 GPUs. The rooms behind it:

- ``launcher/validate/generic.py``: what every field obeys by its declaration (ranges in ``BOUNDS``, the schema's
  ``choice`` values, finite numbers, sizes that can only be typos) and the helpers the section rules share;
- one module of cross-field rules per group of sections: ``model.py`` (model, precision, train),
  ``parallel.py``, ``schedule.py`` (also the zero-bubble rules the layout search reads), ``run.py`` (data,
  checkpoint, logging, cluster, Slurm, job name, profile, determinism); the cross-rules read the job's derived
  ``Layout`` (``launcher.core.derive``), which never raises, so nothing divides by a size the user set to 0;
- ``sections.py``: which rules run, in which order (``raw_problems``);
- ``hints.py``: the hint search, which re-validates a job with each printed alternative applied.

Login-node code: no torch, no megatron.
"""
from __future__ import annotations

from dataclasses import dataclass

from launcher.core import Layout
from launcher.problems import Problem, errors
from launcher.schema import JobConfig
from launcher.validate.hints import verified_hint
from launcher.validate.sections import raw_problems, run_rules

__all__ = ["Problem", "errors", "validate", "check", "Checked", "raw_problems", "verified_hint", "RANK_ACTIONS",
           "rank_side_limits"]


RANK_ACTIONS = ("validate", "render", "submit", "run")
"""Actions that prepare or start a run on this launcher's own ranks (plan, search, list and megatron-args do not)."""


def rank_side_limits(job: JobConfig) -> list[Problem]:
    """What this launcher's ranks cannot run yet although Megatron-Core, the planner and the Megatron-LM export
    can; reported with validation for RANK_ACTIONS only, so such a job still plans, searches and exports."""
    return []


def validate(job: JobConfig) -> list[Problem]:
    """Every problem of every section (errors and warnings), in section order, each hint verified: an
    alternative is printed only when the job with it applied no longer has that problem and has no new error
    (see ``verified_hint``)."""
    return check(job).problems


@dataclass(frozen=True)
class Checked:
    """What validating a job found, handed on by the CLI to the action so that nothing after it validates or
    derives the same job again: its problems (hints verified) and its layout (``launcher.core.derive``; None
    when its sizes are typos too large to derive one from)."""

    problems: list[Problem]
    layout: Layout | None


def check(job: JobConfig) -> Checked:
    """``validate(job)`` with the layout its rules were stated against."""
    problems, lay = run_rules(job)
    return Checked([verified_hint(job, p, problems) for p in problems], lay)
