"""Calibrated cluster profiles: what ``action=bench`` measured, fitted into the planner's efficiency term and
written as a file that ``cluster.profile=PATH`` selects.

One layout's measured step time identifies one number. The term fitted is ``cluster.gemm_efficiency``: the share
of the profile's peak that the layer GEMMs and core attention reach (``launcher/plan/timing.py`` divides both by
peak x gemm_efficiency), the bulk of a step's compute. Everything else keeps the profile's values: element-wise
traffic at HBM bandwidth, the collective and p2p bandwidths and latency, the optimizer step. Whatever those miss
on this machine is absorbed into the fitted efficiency for this layout; how well it carries to other layouts is
measured by ``benchmarks/bench_calibration.py``.

Login-node code: no torch, no megatron. Bench starts processes and reads the files the ranks write.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import tempfile
from pathlib import Path
from typing import Optional

from launcher.problems import Problem
from launcher.schema import JobConfig

FITTED_FIELDS = ("gemm_efficiency",)
"""Cluster fields a calibrated profile sets (the ones one layout's step time identifies)."""
BENCH_STEPS = 8
"""Steps of the measurement run."""
WARMUP_STEPS = 3
"""Steps left out of the measurement (allocation, first-call setup, the CPU rank's matmul probe)."""
LOWEST_EFFICIENCY = 1e-6
"""The fit's floor: below it the planned compute would be over a million times the peak's."""
PROFILE_HINT = "cluster.profile=null (the cluster's own constants), or the file action=bench printed"


class ProfileError(Exception):
    """A cluster.profile that cannot be used; ``problem`` is its one line."""

    def __init__(self, problem: Problem):
        super().__init__(problem.line())
        self.problem = problem


# ------------------------------------------------------------------------------------------------ reading
def read_profile(path: str, cluster) -> dict:
    """The calibrated profile at ``path`` (a YAML mapping with a ``calibrated`` record), checked against the job's
    ``cluster``: it parses, its fitted terms are fractions, and it was measured on the same cluster and GPU kind.
    Raises ProfileError with the one line to print."""
    import yaml

    def refuse(rule: str, hint: str = PROFILE_HINT) -> ProfileError:
        return ProfileError(Problem("cluster.profile", path, rule, hint))

    try:
        text = Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise refuse(f"cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise refuse(f"does not parse as YAML{at} ({getattr(exc, 'problem', None) or 'invalid'})") from None
    record = data.get("calibrated") if isinstance(data, dict) else None
    fitted = record.get("fitted") if isinstance(record, dict) else None
    if not isinstance(fitted, dict) or not fitted:
        raise refuse("is not a calibrated cluster profile (no 'calibrated: {fitted: ...}' record)")
    for key, value in fitted.items():
        if key not in FITTED_FIELDS:
            raise refuse(f"fits {key!r}, which no calibration sets (only {', '.join(FITTED_FIELDS)})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise refuse(f"its fitted {key}={value!r} is not a fraction in (0, 1]")
    name, gpu = data.get("name"), data.get("gpu")
    if (name, str(gpu).lower()) != (cluster.name, str(cluster.gpu).lower()):
        raise refuse(f"was calibrated on cluster {name} (gpu {gpu}); this job runs on cluster {cluster.name} "
                     f"(gpu {cluster.gpu}); a profile carries only to the cluster it measured",
                     f"cluster.profile=null, or cluster={name} (the cluster it measured)")
    return data


def apply_profile(job: JobConfig) -> JobConfig:
    """The job with cluster.profile's fitted terms in place of the cluster's (cluster.profile made absolute); the
    job itself when none is set. Raises ProfileError."""
    path = job.cluster.profile
    if not path:
        return job
    data = read_profile(path, job.cluster)
    fitted = {k: float(v) for k, v in data["calibrated"]["fitted"].items()}
    cluster = dataclasses.replace(job.cluster, profile=str(Path(path).expanduser().resolve()), **fitted)
    return dataclasses.replace(job, cluster=cluster)


def in_use_line(job: JobConfig) -> Optional[str]:
    """One line for plan and search: which calibrated profile is in use, what it sets, from which measurement."""
    if not job.cluster.profile:
        return None
    try:
        record = read_profile(job.cluster.profile, job.cluster)["calibrated"]
    except ProfileError:  # read at compose already; changed since
        return f"calibrated profile: {job.cluster.profile}"
    fitted = ", ".join(f"{k} {v:.4g}" for k, v in record["fitted"].items())
    return (f"calibrated profile in use: {job.cluster.profile} ({fitted}; from {record.get('job', '?')} "
            f"{record.get('layout', '')}, measured {record.get('measured_step_s', float('nan')):.4g} s/step vs "
            f"planned {record.get('planned_step_s', float('nan')):.4g}, {record.get('when', '?')})")


# ------------------------------------------------------------------------------------------------ fitting
def measured_step_s(metrics: dict, warmup: int = WARMUP_STEPS) -> float:
    """Median step time (s) of a run's report/metrics.json, the first ``warmup`` steps left out (all of them if
    the run had no more)."""
    steps = [s["ms_per_step"] for s in metrics.get("steps", []) if "ms_per_step" in s]
    if not steps:
        raise ValueError("report/metrics.json holds no step times")
    kept = steps[warmup:] or steps
    return statistics.median(kept) / 1000.0


def _with_efficiency(job: JobConfig, eff: float) -> JobConfig:
    return dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, gemm_efficiency=eff))


def planned_step_s(job: JobConfig, lay=None, eff: Optional[float] = None) -> float:
    """The planner's step time for ``job`` (at GEMM efficiency ``eff`` when given)."""
    from launcher.plan.timing import step_time

    return step_time(job if eff is None else _with_efficiency(job, eff), lay).step_s


def fit_gemm_efficiency(job: JobConfig, measured_s: float, lay=None) -> tuple[float, bool]:
    """The cluster.gemm_efficiency at which the planner's step time for this job equals ``measured_s`` (bisection
    in log space: the step shrinks as the efficiency grows), and whether it hit a bound (the measured step is
    shorter than the plan at efficiency 1, or longer than at LOWEST_EFFICIENCY)."""
    lo, hi = LOWEST_EFFICIENCY, 1.0
    if planned_step_s(job, lay, hi) >= measured_s:
        return hi, True
    if planned_step_s(job, lay, lo) <= measured_s:
        return lo, True
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        if planned_step_s(job, lay, mid) > measured_s:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-6:
            break
    return (lo * hi) ** 0.5, False


# ------------------------------------------------------------------------------------------------ writing
def profile_path(report_dir: Path, cluster_name: str) -> Path:
    return Path(report_dir) / f"calibrated-{cluster_name}.yaml"


def calibrated_profile(job: JobConfig, fitted: dict, record: dict) -> dict:
    """The cluster profile as the job has it (cluster.* fields, profile itself left out) with the fitted terms and
    the ``calibrated`` record: the same schema as recipes/cluster/*.yaml plus the record."""
    data = {k: v for k, v in dataclasses.asdict(job.cluster).items() if k not in ("profile", "secret_env")}
    data.update(fitted)
    data["calibrated"] = {"fitted": dict(fitted), **record}
    return data


def write_profile(path: Path, data: dict) -> Path:
    """Write the profile atomically (a temporary file in the same directory, then rename): a reader sees the old
    file or the whole new one."""
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = ("# Calibrated cluster profile written by action=bench: the cluster's profile with the fitted terms\n"
              "# (calibrated.fitted) in place. Select it with cluster.profile=" + str(path) + "\n")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w") as out:
            out.write(header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def calibrate(job: JobConfig, metrics: dict, report_dir: Path, *, layout_text: str, lay=None) -> dict:
    """Fit the job's measured step (``metrics``: its report/metrics.json) and write the calibrated profile into
    ``report_dir``; returns what was found (measured, planned before and after, the fitted value, the path)."""
    measured = measured_step_s(metrics)
    planned = planned_step_s(job, lay)
    eff, bounded = fit_gemm_efficiency(job, measured, lay)
    steps = len(metrics.get("steps", []))
    record = {"job": job.name, "layout": layout_text, "when": datetime.datetime.now(datetime.timezone.utc)
              .strftime("%Y-%m-%dT%H:%M:%SZ"), "measured_step_s": round(measured, 6),
              "planned_step_s": round(planned, 6), "planned_with_fit_s": round(planned_step_s(job, lay, eff), 6),
              "gemm_efficiency_before": job.cluster.gemm_efficiency,
              "steps": steps, "warmup_steps_left_out": min(WARMUP_STEPS, max(0, steps - 1)),
              "statistic": "median step time after warm-up", "at_bound": bounded}
    path = write_profile(profile_path(report_dir, job.cluster.name),
                         calibrated_profile(job, {"gemm_efficiency": round(eff, 6)}, record))
    return {**record, "gemm_efficiency": round(eff, 6), "path": str(path)}
