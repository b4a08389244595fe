"""Calibrated cluster profiles: what ``action=bench`` measured, fitted into the planner's terms and written as a
file that ``cluster.profile=PATH`` selects.

One layout's step time alone identifies one number. The bench run also records every rank's forward and backward
of every microbatch (``schedule.record_timeline``: spans.json, with each span's CPU seconds on CPU), which gives one
equation per pipeline stage and pass. Three terms are fitted, each from what identifies it:

- ``cluster.gemm_efficiency`` (the share of the profile's peak that GEMMs and core attention reach) and
  ``cluster.op_overhead_us`` (a fixed cost per eager op of a layer pass, serial with its arithmetic) by least
  squares over the per-stage, per-pass times: the stages differ in FLOPs (the last one holds the output layer)
  more than in ops, so the two separate;
- on CPU, ``cluster.compute_units_per_node`` (how many ranks' worth of work the node runs at once: cores shared by
  four ranks and by whatever else runs there) so that the plan's step equals the measured step; on a GPU (no
  sharing) the GEMM efficiency is refitted to the step instead, the op cost kept.

Without spans (interleaved layouts record none) only the GEMM efficiency is fitted, to the step. Everything else
keeps the profile's values. How well the fit carries to other layouts is measured by
``benchmarks/bench_calibration.py``.

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

FITTED_FIELDS = ("gemm_efficiency", "op_overhead_us", "compute_units_per_node")
"""Cluster fields a calibrated profile may set."""
FIELD_RULES = {"gemm_efficiency": (lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
               "op_overhead_us": (lambda v: 0 <= v <= 1e6, "microseconds in [0, 1e6]"),
               "compute_units_per_node": (lambda v: 0 < v <= 1e6, "a number of compute units in (0, 1e6]")}
"""What each fitted value must be to be used (the same ranges validation holds the cluster fields to)."""
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
        holds, what = FIELD_RULES[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not holds(value):
            raise refuse(f"its fitted {key}={value!r} is not {what}")
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


def _with(job: JobConfig, **fields) -> JobConfig:
    return dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, **fields))


def _with_efficiency(job: JobConfig, eff: float) -> JobConfig:
    return _with(job, gemm_efficiency=eff)


def planned_step_s(job: JobConfig, lay=None, eff: Optional[float] = None) -> float:
    """The planner's step time for ``job`` (at GEMM efficiency ``eff`` when given)."""
    from launcher.plan.timing import step_time

    return step_time(job if eff is None else _with_efficiency(job, eff), lay).step_s


def _bisect(planned, measured_s: float, lo: float, hi: float) -> tuple[float, bool]:
    """The value in [lo, hi] (log-space bisection) at which ``planned(value)``, decreasing in it, equals
    ``measured_s``; and whether it hit a bound."""
    if planned(hi) >= measured_s:
        return hi, True
    if planned(lo) <= measured_s:
        return lo, True
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        if planned(mid) > measured_s:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-6:
            break
    return (lo * hi) ** 0.5, False


def fit_gemm_efficiency(job: JobConfig, measured_s: float, lay=None) -> tuple[float, bool]:
    """The cluster.gemm_efficiency at which the planner's step time for this job equals ``measured_s`` (the step
    shrinks as the efficiency grows), and whether it hit a bound (the measured step is shorter than the plan at
    efficiency 1, or longer than at LOWEST_EFFICIENCY)."""
    return _bisect(lambda e: planned_step_s(job, lay, e), measured_s, LOWEST_EFFICIENCY, 1.0)


def fit_compute_units(job: JobConfig, measured_s: float, lay=None) -> tuple[Optional[float], bool]:
    """The cluster.compute_units_per_node at which the plan's step equals ``measured_s`` (fewer units, longer
    step); None when the plan without sharing is already as long (sharing does not bind), with True."""
    if planned_step_s(_with(job, compute_units_per_node=None), lay) >= measured_s:
        return None, True
    return _bisect(lambda u: planned_step_s(_with(job, compute_units_per_node=u), lay), measured_s, 1e-3, 1e6)


def measured_passes(spans: dict, warmup: int = WARMUP_STEPS) -> Optional[dict]:
    """Seconds per microbatch of each pipeline stage's passes in a bench run's timeline/spans.json: {stage: {"f":
    ..., "bw": ... (B + W) or "b" and "w"}}, the median over the ranks of a stage and the steps after ``warmup`` of
    each rank's mean per op. CPU seconds where the spans carry them (a rank's wall time includes the time it
    waited for a core), else wall (a GPU's CUDA-event times). None when nothing usable is recorded (interleaved
    runs record no spans; chunked layouts are left out: the planner's costs are per stage)."""
    per_stage: dict = {}
    for rank in spans.get("ranks", []):
        steps, cpu = rank.get("steps") or [], rank.get("cpu_steps")
        for i, step in enumerate(steps[warmup:] if len(steps) > warmup else steps):
            j = i + (warmup if len(steps) > warmup else 0)
            sums: dict = {}
            for n, (kind, _mb, chunk, start, end) in enumerate(step):
                if chunk:
                    return None
                seconds = cpu[j][n] if cpu else end - start
                key = {"F": "f", "B": "b", "W": "w", "BW": "bw"}.get(kind)
                if key:
                    total, count = sums.get(key, (0.0, 0))
                    sums[key] = (total + seconds, count + 1)
            for key, (total, count) in sums.items():
                per_stage.setdefault(rank["pp"], {}).setdefault(key, []).append(total / count)
    if not per_stage:
        return None
    return {stage: {k: statistics.median(v) for k, v in kinds.items()} for stage, kinds in per_stage.items()}


def _pass_terms(job: JobConfig, lay, stage: int) -> dict:
    """Per pass of ``stage`` ("f", "b", "w", "bw"): (a, o, k) with planned seconds = a / gemm_efficiency +
    o x op_overhead_us + k (the planner is linear in both terms per pass)."""
    from launcher.plan.timing import stage_costs

    def costs(eff, per_op):
        c = stage_costs(_with(job, gemm_efficiency=eff, op_overhead_us=per_op, compute_units_per_node=None),
                        lay, stage)
        return {"f": c.f, "b": c.b, "w": c.w, "bw": c.b + c.w}

    one, half, op = costs(1.0, 0.0), costs(0.5, 0.0), costs(1.0, 1.0)
    return {k: (half[k] - one[k], op[k] - one[k], 2 * one[k] - half[k]) for k in one}


def fit_passes(job: JobConfig, passes: dict, lay=None) -> Optional[tuple[float, float, float]]:
    """(gemm_efficiency, op_overhead_us, rms relative residual) fitted to the measured passes by least squares
    on relative errors (x = 1/efficiency and the op cost enter linearly); x held at 1 or the op cost at 0 where
    the unconstrained fit leaves its range. None when the passes do not determine them."""
    from launcher.core import derive

    lay = lay or derive(job)
    rows = []
    for stage, kinds in passes.items():
        terms = _pass_terms(job, lay, stage)
        for key, seconds in kinds.items():
            a, o, k = terms[key]
            if seconds > 0:
                rows.append((a / seconds, o / seconds, (seconds - k) / seconds))

    def solve(use_x: bool, use_o: bool):
        if use_x and use_o:
            saa = sum(a * a for a, _, _ in rows)
            soo = sum(o * o for _, o, _ in rows)
            sao = sum(a * o for a, o, _ in rows)
            say, soy = sum(a * y for a, _, y in rows), sum(o * y for _, o, y in rows)
            det = saa * soo - sao * sao
            if det <= 1e-12 * saa * soo:
                return None
            return (say * soo - soy * sao) / det, (soy * saa - say * sao) / det
        if use_x:  # op cost 0
            saa = sum(a * a for a, _, _ in rows)
            return (sum(a * y for a, _, y in rows) / saa if saa else None), 0.0
        soo = sum(o * o for _, o, _ in rows)  # x = 1: the whole peak, the rest per op
        return 1.0, (sum(o * (y - a) for a, o, y in rows) / soo if soo else None)

    if len(rows) < 2:
        return None
    x, per_op = solve(True, True) or (None, None)
    if x is None or per_op is None or per_op < 0 or x < 1:
        x, per_op = solve(True, False) if (x is None or per_op is None or per_op < 0) else solve(False, True)
    if x is None or per_op is None or x < 1 or per_op < 0:
        return None
    rms = (sum((a * x + o * per_op - y) ** 2 for a, o, y in rows) / len(rows)) ** 0.5
    return 1.0 / x, per_op, rms


# ------------------------------------------------------------------------------------------------ where it runs
def visible_gpus() -> tuple[int, str]:
    """(GPUs this machine shows, how that was found): ``nvidia-smi -L``'s lines, limited by CUDA_VISIBLE_DEVICES
    when set; 0 without nvidia-smi. The login side may not import torch to ask CUDA."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, "no nvidia-smi on this machine"
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0, "nvidia-smi -L failed"
    count = sum(1 for line in listed.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
        return count, f"nvidia-smi -L, CUDA_VISIBLE_DEVICES={visible}"
    return count, "nvidia-smi -L"


def cannot_stand_in(job: JobConfig, lay) -> Optional[Problem]:
    """The one line for a GPU job whose layout needs more GPUs than this machine shows (bench runs the job's own
    layout here, one rank per GPU); None when it fits (or runs on CPU)."""
    if str(job.cluster.gpu).lower() == "cpu":
        return None
    have, how = visible_gpus()
    if have >= lay.world:
        return None
    return Problem("action", "bench", f"the job's layout (TP{lay.tp} PP{lay.pp} CP{lay.cp} DP{lay.dp}) runs "
                   f"{lay.world} ranks, one per GPU, and this machine shows {have} ({how})",
                   f"action=bench on a node with {lay.world} GPUs (the cluster's first node)"
                   + (f", or cluster.gpus_per_node={have} with parallel.* to match" if have else ""))


# ------------------------------------------------------------------------------------------------ memory
STATIC_TOLERANCE = 0.01
"""How far a stage's measured static bytes may be from the plan's: the tolerance the planner's memory tests hold
it to against Megatron-Core's allocations (tests/test_plan_memory_real.py)."""


def memory_rows(job: JobConfig, metrics: dict, lay=None) -> list[dict]:
    """Per pipeline stage: the planned peak (reserve left out) and the measured one (max_memory_allocated on GPU,
    peak RSS on CPU, which includes the interpreter and libraries), and the static bytes (weights, gradient
    buffers, optimizer state) planned and measured on the stage's largest rank, with whether they agree within
    STATIC_TOLERANCE."""
    from launcher.core import derive
    from launcher.plan import plan_job
    from launcher.plan.memory import stage_params, static_bytes

    lay = lay or derive(job)
    measured = {s["stage"]: s for s in metrics.get("final", {}).get("memory_by_stage", [])}
    rows = []
    for st in plan_job(job).stages:
        got = measured.get(st.stage, {})
        planned_static = static_bytes(job, stage_params(job, st.stage, lay), lay)
        planned_static = sum(planned_static.get(k, 0.0) for k in ("weights", "grads", "optimizer"))
        real = got.get("static_bytes")
        real_static = sum(real.values()) if real else None
        rows.append({"stage": st.stage, "planned_gb": (st.total - st.parts.get("reserve", 0.0)) / 1e9,
                     "measured_gib": got.get("peak_gib"), "basis": got.get("basis"),
                     "static_planned_bytes": planned_static, "static_measured_bytes": real_static,
                     "static_within_tolerance": (None if not real_static else
                                                 abs(planned_static - real_static) <= STATIC_TOLERANCE * real_static)})
    return rows


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


def fit_profile(job: JobConfig, measured_s: float, passes: Optional[dict], lay=None) -> tuple[dict, dict, bool]:
    """(fitted cluster fields, where each came from, whether the last fit hit a bound) for a run whose median step
    was ``measured_s`` and whose per-stage passes (:func:`measured_passes`) were ``passes`` (None: not recorded).
    ``cpu``: the passes are CPU seconds (a "cpu" key in ``passes``), so the node's ranks share compute units."""
    fitted, sources = {}, {}
    on_cpu = bool(passes and passes.pop("cpu", False))
    by_pass = fit_passes(job, passes, lay) if passes else None
    if by_pass is not None:
        eff, per_op, rms = by_pass
        fitted.update(gemm_efficiency=eff, op_overhead_us=per_op)
        what = "CPU seconds" if on_cpu else "device seconds"
        sources["gemm_efficiency"] = sources["op_overhead_us"] = (
            f"least squares over {sum(len(k) for k in passes.values())} per-stage pass times ({what} per "
            f"microbatch, spans.json), rms residual {rms:.1%}")
        job = _with(job, gemm_efficiency=eff, op_overhead_us=per_op)
    if by_pass is not None and on_cpu:
        units, bounded = fit_compute_units(job, measured_s, lay)
        if units is not None:
            fitted["compute_units_per_node"] = units
            sources["compute_units_per_node"] = "the measured step time (median after warm-up), the passes' fit held"
        return fitted, sources, bounded
    eff, bounded = fit_gemm_efficiency(job, measured_s, lay)
    fitted["gemm_efficiency"] = eff
    sources["gemm_efficiency"] = ("the measured step time (median after warm-up)"
                                  + (", op cost from the passes held" if by_pass is not None else
                                     "; no per-stage passes recorded (interleaved or chunked layout)"))
    return fitted, sources, bounded


def read_passes(bundle: Path) -> Optional[dict]:
    """:func:`measured_passes` of a bench bundle's timeline/spans.json (with "cpu": True when they are CPU
    seconds), or None when the run recorded none."""
    import json

    path = Path(bundle) / "timeline" / "spans.json"
    if not path.is_file():
        return None
    spans = json.loads(path.read_text())
    passes = measured_passes(spans)
    if passes is not None and any(r.get("cpu_steps") for r in spans.get("ranks", [])):
        passes["cpu"] = True
    return passes


def calibrate(job: JobConfig, metrics: dict, report_dir: Path, *, layout_text: str, lay=None,
              passes: Optional[dict] = None) -> dict:
    """Fit the job's measured step (``metrics``: its report/metrics.json) and per-stage passes (``passes``:
    :func:`read_passes` of its bundle) and write the calibrated profile into ``report_dir``; returns what was
    found (measured, planned before and after, the fitted values and their sources, the path)."""
    measured = measured_step_s(metrics)
    planned = planned_step_s(job, lay)
    recorded = {k: v for k, v in (passes or {}).items() if k != "cpu"}
    fitted, sources, bounded = fit_profile(job, measured, dict(passes) if passes else None, lay)
    fitted = {k: round(v, 6) for k, v in fitted.items()}
    steps = len(metrics.get("steps", []))
    record = {"job": job.name, "layout": layout_text, "when": datetime.datetime.now(datetime.timezone.utc)
              .strftime("%Y-%m-%dT%H:%M:%SZ"), "measured_step_s": round(measured, 6),
              "planned_step_s": round(planned, 6),
              "planned_with_fit_s": round(planned_step_s(_with(job, **fitted), lay), 6),
              "before": {k: getattr(job.cluster, k) for k in fitted}, "sources": sources,
              "measured_passes_s": {int(st): {k: round(v, 6) for k, v in kinds.items()}
                                    for st, kinds in sorted(recorded.items())},
              "gemm_efficiency_before": job.cluster.gemm_efficiency,
              "steps": steps, "warmup_steps_left_out": min(WARMUP_STEPS, max(0, steps - 1)),
              "statistic": "median step time after warm-up", "at_bound": bounded}
    path = write_profile(profile_path(report_dir, job.cluster.name), calibrated_profile(job, fitted, record))
    return {**record, "fitted": fitted, "gemm_efficiency": fitted["gemm_efficiency"], "path": str(path)}
