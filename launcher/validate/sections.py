"""Which rules run, in which order: the problems of a job as its rules state them (hints not yet checked).
Login-node code.
"""
from __future__ import annotations

from typing import Callable

from launcher.core import Layout, derive
from launcher.problems import Problem, errors
from launcher.schema import JobConfig
from launcher.validate.generic import validate_bounds, validate_choices, validate_finite, validate_sizes
from launcher.validate.model import (validate_activation_offload, validate_cuda_graphs, validate_model,
                                     validate_optimizer_levers, validate_precision, validate_train)
from launcher.validate.parallel import validate_parallel
from launcher.validate.run import (validate_checkpoint, validate_cluster, validate_data, validate_deterministic,
                                   validate_job, validate_loaded_weights, validate_logging, validate_post,
                                   validate_profile, validate_slurm)
from launcher.validate.schedule import validate_schedule


SECTION_CHECKS: tuple[Callable[[JobConfig, Layout], list[Problem]], ...] = (
    lambda j, lay: validate_job(j),
    lambda j, lay: validate_choices(j),
    lambda j, lay: validate_model(j.model),
    lambda j, lay: validate_cluster(j),
    validate_parallel,
    validate_schedule,
    validate_precision,
    validate_optimizer_levers,
    validate_cuda_graphs,
    validate_activation_offload,
    validate_train,
    lambda j, lay: validate_data(j.data),
    lambda j, lay: validate_checkpoint(j.checkpoint),
    lambda j, lay: validate_loaded_weights(j),
    lambda j, lay: validate_logging(j.logging),
    lambda j, lay: validate_slurm(j),
    validate_profile,
    lambda j, lay: validate_deterministic(j),
    lambda j, lay: validate_post(j),
)
"""Each section's rules, in report order; the cross-section ones read the derived layout."""


def raw_problems(job: JobConfig) -> list[Problem]:
    """The problems as the rules state them, hints unchecked."""
    return run_rules(job)[0]


def run_rules(job: JobConfig) -> tuple[list[Problem], Layout | None]:
    """The problems as the rules state them, and the layout they were stated against (None when the sizes are
    typos too large to derive one from)."""
    problems = validate_sizes(job) + validate_finite(job)
    if errors(problems):
        return problems, None
    problems += validate_bounds(job)
    lay = derive(job)
    for check in SECTION_CHECKS:
        try:
            problems.extend(check(job, lay))
        except Exception as exc:  # noqa: BLE001  -- a rule that cannot be stated is reported, never a traceback
            problems.append(Problem("config", f"{type(exc).__name__}: {exc}",
                                    "a validation rule could not be evaluated (a bug in launcher/validate/)",
                                    "fix the other reported problems first"))
    return problems, lay
