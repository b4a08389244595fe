"""Rules of what a run reads and writes and where it runs: data, checkpoint (and the weights it loads), logging,
cluster, Slurm, the run name, profiling and deterministic mode. Login-node code.
"""
from __future__ import annotations

import math
import os
import re

from launcher import ROOT
from launcher.core import Layout
from launcher.core.blend import is_number, parse_blend
from launcher.core.determinism import ACCEPTED as ACCEPTED_DETERMINISTIC
from launcher.core.paths import length_problem, loop_problem, path_values
from launcher.core.time_limit import slurm_seconds
from launcher.fields import get_value, is_allowed
from launcher.problems import Problem
from launcher.schema import CheckpointConfig, DataConfig, JobConfig, LoggingConfig, Profiler
from launcher.validate.generic import Checks, in_bounds


SBATCH_WORD = re.compile(r"[A-Za-z0-9_.,-]+")

SBATCH_PATH = re.compile(r"[A-Za-z0-9_./+:@=-]+")

WANDB_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")

SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)


def validate_data(data: DataConfig) -> list[Problem]:
    c = Checks()
    if not is_allowed(data, "kind"):
        return c.problems  # reported by validate_choices
    parts = [s.strip() for s in str(data.split).split(",")]
    c.need(len(parts) == 3 and all(is_number(s) and 0 <= float(s) < math.inf for s in parts) and any(float(s) > 0 for s in parts if is_number(s)),
           "data.split", data.split, "must be three non-negative weights train,valid,test", "data.split='969,30,1'")
    c.need(data.kind != "mock" or not data.blend, "data.kind", data.kind,
           "mock data ignores data.blend: a blend was given but would never be read",
           "data.blend=[] or data.kind=indexed")
    if data.kind == "indexed":
        c.need(len(data.blend) > 0, "data.blend", list(data.blend), "indexed data needs at least one dataset prefix",
               "list your dataset prefixes in data.blend or data=mock")
        c.need(bool(data.tokenizer), "data.tokenizer", data.tokenizer, "indexed data needs a tokenizer.json path",
               f"data.tokenizer={ROOT / 'data' / 'assets' / 'tokenizer.json'}")  # absolute: relative means the cwd
        problem = blend_structure_problem(list(data.blend))
        if problem:
            c.problems.append(problem)
    return c.problems


def blend_structure_problem(blend: list) -> Problem | None:
    try:
        pairs = parse_blend(blend)
    except ValueError:
        return Problem("data.blend", blend, "must be [prefix, ...] or [weight, prefix, weight, prefix, ...]",
                       "data.blend=[0.3,path/a,0.7,path/b]")
    bad = [w for w, _ in pairs if not (w > 0 and math.isfinite(w))]
    if bad:
        kept = [f"{w:g},{p}" for w, p in pairs if w > 0 and math.isfinite(w)]  # the blend without those datasets
        hint = f"data.blend=[{','.join(kept)}]" if kept else "a positive weight for each dataset"
        return Problem("data.blend", blend, f"weights must be positive finite numbers (got {bad[0]:g})", hint)
    return None


def validate_checkpoint(ckpt: CheckpointConfig) -> list[Problem]:
    c = Checks()
    if ckpt.load is not None:
        c.need(str(ckpt.load).strip() != "", "checkpoint.load", ckpt.load,
               "names a checkpoint (an iter_* directory) or a checkpoint dir holding some",
               "checkpoint.load=/lustre/ckpt/run/iter_0001000")
    if ckpt.load_hf is not None:  # rendering imports it and sets checkpoint.load (launcher/preflight.py hf_start)
        c.need(ckpt.load is None, "checkpoint.load_hf", ckpt.load_hf,
               f"a run starts from one thing; checkpoint.load={ckpt.load} is set too", "checkpoint.load=null")
        c.need(bool(str(ckpt.load_hf).strip()) and os.path.isfile(os.path.join(str(ckpt.load_hf), "config.json")),
               "checkpoint.load_hf", ckpt.load_hf,
               "names a Hugging Face model directory (config.json and safetensors weights); no config.json there",
               "checkpoint.load_hf=null")
    return c.problems


def validate_loaded_weights(job: JobConfig) -> list[Problem]:
    """checkpoint.load of an ``import-hf`` checkpoint (weights only): its launcher.json records the model fields that
    shape its tensors (launcher/core/checkpoint/weights.py weights_of); each one this job's model sets differently is one
    problem here, before any rank starts (the ranks check the same, launcher/rank/checkpoint/store.py weights_mismatch).
    A path this node cannot read is left to the ranks."""
    from launcher.core.checkpoint.directory import read_manifest

    if not job.checkpoint.load:
        return []
    manifest = read_manifest(job.checkpoint.load)
    recorded = manifest.get("weights_of") if isinstance(manifest, dict) else None
    if not isinstance(recorded, dict):
        return []
    problems = []
    for key, theirs in sorted(recorded.items()):
        ours = getattr(job.model, key.partition(".")[2], None)
        if key.startswith("model.") and ours != theirs:
            problems.append(Problem(key, ours, f"the weights of checkpoint.load={job.checkpoint.load} have "
                                    f"{key}={theirs!r}", f"{key}={'null' if theirs is None else theirs}"))
    return problems


def validate_logging(logging: LoggingConfig) -> list[Problem]:
    c = Checks()
    # wandb refuses project and entity names with '/', '\\', '#', '?', '%', ':' (every rank would fail in
    # wandb.init); ';' and spaces are refused too so the names stay shell- and path-safe.
    for name, value in (("logging.wandb_project", logging.wandb_project), ("logging.wandb_entity", logging.wandb_entity)):
        if value is not None:
            c.need(WANDB_NAME.fullmatch(str(value)) is not None, name, value,
                   "wandb names are 1-128 letters, digits, '.', '_' and '-'", f"{name}=my_project")
    return c.problems


def validate_cluster(job: JobConfig) -> list[Problem]:
    c = Checks()
    cl = job.cluster
    if in_bounds(job, "cluster.gpu_memory_gb", "cluster.memory_reserve_gb"):
        c.need(cl.memory_reserve_gb < cl.gpu_memory_gb, "cluster.memory_reserve_gb", cl.memory_reserve_gb,
               f"must be less than cluster.gpu_memory_gb={cl.gpu_memory_gb:g}", "cluster.memory_reserve_gb=4.0")
    c.need(not (cl.gpu == "cpu" and cl.backend == "nccl"), "cluster.backend", cl.backend,
           "NCCL needs GPUs; a cpu cluster uses gloo", "cluster.backend=gloo")
    c.need(cl.launcher != "local" or job.nodes == 1, "nodes", job.nodes,
           "a local cluster runs on this one machine", "nodes=1 or cluster=h200 (to submit with Slurm)")
    c.need(job.action != "run" or cl.launcher == "local", "action", job.action,
           f"action=run starts torchrun on this machine; cluster {cl.name} launches through Slurm",
           "action=submit or cluster=local")
    # the exclusion is a new Slurm job without the node (job.sbatch.j2); a local run has no scheduler to ask
    c.need(job.slurm.on_hang != "exclude" or cl.launcher == "slurm", "slurm.on_hang", job.slurm.on_hang,
           f"cluster {cl.name} runs on this machine: a hang stops the run, no node can be left out",
           "slurm.on_hang=stop (or a Slurm profile such as cluster=h200)", severity="warning")
    c.need(job.action != "submit" or cl.launcher == "slurm", "action", job.action,
           f"action=submit needs a Slurm cluster profile; cluster {cl.name} runs locally",
           "action=run or a Slurm profile such as cluster=h200")
    for name, value in cl.env.items():
        c.need(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(name)) is not None, f"cluster.env.{name}", value,
               "environment variable names are letters, digits and _", "cluster.env.MY_VAR=value")
        c.need(not SECRET_NAME.search(str(name)), f"cluster.env.{name}", "<redacted>",
               "secrets are never written into a run bundle", f"export {name} in your shell and add it to cluster.secret_env")
    for name in cl.secret_env:
        c.need(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(name)) is not None, "cluster.secret_env", name,
               "must list environment variable names", "cluster.secret_env=[WANDB_API_KEY]")
    for mount in cl.container_mounts:
        c.need(":" in str(mount) and all(str(mount).split(":")[:2]), "cluster.container_mounts", mount,
               "each mount is src:dst", "cluster.container_mounts=[/lustre:/lustre]")
    if cl.container_image:
        _validate_paths_in_mounts(c, job)
    return c.problems


def _validate_paths_in_mounts(c: Checks, job: JobConfig) -> None:
    """With a container, every path the job reads or writes must be visible inside it (under a mount dst)."""
    dsts = [str(m).split(":")[1].rstrip("/") for m in job.cluster.container_mounts if ":" in str(m)]
    paths: list[tuple[str, str]] = [("output_dir", job.output_dir)]
    if job.checkpoint.dir:
        paths.append(("checkpoint.dir", job.checkpoint.dir))
    if job.data.kind == "indexed":
        if job.data.tokenizer:
            paths.append(("data.tokenizer", job.data.tokenizer))
        try:
            paths += [("data.blend", prefix) for _, prefix in parse_blend(list(job.data.blend))]
        except ValueError:
            pass
    if job.data.cache_dir:
        paths.append(("data.cache_dir", job.data.cache_dir))
    for field, path in paths:
        c.need(path.startswith("/") and any(path == d or path.startswith(d + "/") for d in dsts), field, path,
               f"must be an absolute path inside a container mount ({', '.join(dsts) or 'none'})",
               f"cluster.container_mounts=[{path.rsplit('/', 1)[0] or '/'}:{path.rsplit('/', 1)[0] or '/'}]")


def validate_slurm(job: JobConfig) -> list[Problem]:
    c = Checks()
    s = job.slurm
    seconds = slurm_seconds(s.time)
    c.need(seconds is not None, "slurm.time", s.time, "must be [D-]HH:MM:SS", "slurm.time=04:00:00")
    if seconds is not None and s.signal_lead_s is None:  # derived at render (launcher/core/signal_lead.py)
        c.need(not 0 <= s.signal_margin_s or s.signal_margin_s + 60 <= seconds // 2, "slurm.signal_margin_s",
               s.signal_margin_s, f"must leave half of the {seconds} s time limit for training (margin + 60 s)",
               f"slurm.signal_margin_s={min(60, max(0, seconds // 2 - 60))}")
    elif seconds is not None:  # (a negative lead is BOUNDS' to report)
        c.need(s.signal_lead_s < seconds or s.signal_lead_s < 0, "slurm.signal_lead_s", s.signal_lead_s,
               f"must be shorter than the time limit ({seconds} s)", f"slurm.signal_lead_s={seconds // 10}")
        # slurmctld checks time limits every ~30 s, so USR1 can come that much earlier than asked; a lead that
        # close to the limit makes every requeued run stop as soon as it starts.
        if 0 <= s.signal_lead_s < seconds:
            c.need(s.signal_lead_s + 60 <= seconds, "slurm.signal_lead_s", s.signal_lead_s,
                   f"leaves under 60 s of the {seconds} s limit before the stop signal (Slurm may signal ~30 s early)",
                   f"slurm.signal_lead_s={max(0, seconds // 10)}", severity="warning")
    # #SBATCH lines are read by sbatch, not by a shell, so quoting cannot protect them: restrict their values.
    for name, value in (("cluster.partition", job.cluster.partition), ("cluster.account", job.cluster.account),
                        ("slurm.job_name", s.job_name)):
        if value is not None:
            c.need(SBATCH_WORD.fullmatch(str(value)) is not None, name, value,
                   "Slurm names are letters, digits, '.', ',', '_' and '-'", f"{name}=batch")
    if job.cluster.launcher == "slurm":
        bundle_parent = os.path.abspath(job.output_dir)  # relative output_dir resolves against the cwd
        c.need(SBATCH_PATH.fullmatch(bundle_parent) is not None, "output_dir", bundle_parent,
               "the bundle path appears in #SBATCH --output: no spaces, quotes, '%' or shell characters",
               "output_dir=/lustre/$USER/runs (spelled out)")
    for arg in s.extra_args:
        c.need(str(arg).startswith("--") and "\n" not in str(arg), "slurm.extra_args", arg,
               "each entry is one long sbatch option", "slurm.extra_args=[--qos=high]")
    # slurm.max_requeues, cluster.max_restarts, the signal factor and margin: ranges in BOUNDS
    return c.problems


MAX_NAME = 128
"""Longest run name (the bundle directory adds a 16-character stamp and a counter; file names stop at 255 bytes)."""


def validate_job(job: JobConfig) -> list[Problem]:
    c = Checks()
    c.need(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", job.name or "") is not None, "name", job.name,
           "run names are letters, digits, '.', '_' and '-'", "name=my_run")
    c.need(len(job.name or "") <= MAX_NAME, "name", job.name, f"run names are at most {MAX_NAME} characters (the "
           "bundle directory <name>-<UTC stamp> must fit a file name's 255 bytes, the Slurm job name stays readable)",
           f"name={(job.name or 'run')[:40]}")
    for field, value in path_values(job):  # render and the ranks would fail on it with ENAMETOOLONG
        if field in LENGTH_CHECKED:
            why = length_problem(value) or loop_problem(value)
            c.need(why is None, field, value, why, LENGTH_CHECKED[field])
    return c.problems


LENGTH_CHECKED = {"output_dir": "output_dir=runs", "checkpoint.dir": "checkpoint.dir=null",
                  "checkpoint.load": "checkpoint.load=null", "data.cache_dir": "data.cache_dir=null"}
"""Path fields that nothing else reads on the login node, with the alternative to a path that is too long (a too
long data.blend prefix, data.tokenizer or checkpoint.load_hf is a file not found: their own rules say so)."""


def validate_profile(job: JobConfig, lay: Layout) -> list[Problem]:
    """profile.*: a step range the run reaches, ranks that exist, nsys and memory snapshots only where CUDA is."""
    c, p = Checks(), job.profile
    if p.kind != Profiler.NONE:
        c.need(p.step_end > p.step_start, "profile.step_end", p.step_end,
               f"must be after profile.step_start={p.step_start} (profiling stops before step_end)",
               f"profile.step_end={p.step_start + 2}")
        if lay.steps:
            c.need(p.step_start <= lay.steps, "profile.step_start", p.step_start,
                   f"the run has {lay.steps} steps: profiling would never start",
                   f"profile.step_start={max(1, min(3, lay.steps))}")
        bad = [r for r in p.ranks if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < lay.world]
        c.need(bool(p.ranks) and not bad, "profile.ranks", list(p.ranks),
               f"must name global ranks of this job (0..{lay.world - 1})", "profile.ranks=[0]")
        c.need(p.kind != Profiler.NSYS or job.cluster.gpu != "cpu", "profile.kind", p.kind,
               "Nsight Systems captures CUDA work; this job runs on CPU", "profile.kind=torch")
    c.need(not p.memory_snapshot or job.cluster.gpu != "cpu", "profile.memory_snapshot", p.memory_snapshot,
           "records the CUDA caching allocator; this job runs on CPU, so there is nothing to record",
           "profile.memory_snapshot=false", severity="warning")
    return c.problems


def validate_deterministic(job: JobConfig) -> list[Problem]:
    """train.deterministic: the settings and cluster.env values Megatron-LM's --deterministic-mode refuses."""
    from launcher.core.determinism import ENV_DEFAULTS, REFUSED_SETTINGS, env_problems

    c = Checks()
    if not job.train.deterministic:
        return c.problems
    for name, why, needed in REFUSED_SETTINGS:
        value = get_value(job, name)
        c.need(value == needed, name, value, f"train.deterministic=true refuses it: {why}",
               f"{name}={str(needed).lower()} or train.deterministic=false")
    for var, value, rule in env_problems(dict(job.cluster.env)):
        fix = ENV_DEFAULTS.get(var) or (ACCEPTED_DETERMINISTIC.get(var) or ("1",))[0]
        c.need(False, f"cluster.env.{var}", value, f"train.deterministic=true: {rule}", f"cluster.env.{var}={fix}")
    return c.problems


def validate_post(job: JobConfig) -> list[Problem]:
    """post.*: the steps after training need a kept checkpoint to work on and, for eval, held-out tokens to read
    (launcher/hf/post.py walks the checkpoints the run keeps and reads the blend's documents)."""
    c, p, ckpt = Checks(), job.post, job.checkpoint
    asked = [name for name, on in (("post.eval", p.eval), ("post.export_hf", p.export_hf)) if on]
    if asked:
        c.need(ckpt.save_interval > 0 or ckpt.save_at_end, asked[0], True,
               "runs on the checkpoints training keeps, and this run keeps none (checkpoint.save_interval=0 and "
               "checkpoint.save_at_end=false)", "checkpoint.save_at_end=true")
    if p.eval:
        c.need(bool(p.eval_blend) or job.data.kind == "indexed", "post.eval", True,
               f"needs held-out tokens: post.eval_blend is empty and data.kind={job.data.kind} has no validation "
               "split to read", "post.eval_blend=[path/to/heldout_text_document]")
        if not p.eval_blend and job.data.kind == "indexed":
            parts = [s.strip() for s in str(job.data.split).split(",")]
            valid = float(parts[1]) if len(parts) == 3 and is_number(parts[1]) else 1.0
            c.need(valid > 0, "post.eval", True, f"reads the validation split of data.blend, and data.split="
                   f"{job.data.split} gives it no documents", "data.split='98,2,0' or a post.eval_blend")
    if p.eval_blend:
        problem = blend_structure_problem(list(p.eval_blend))
        if problem is not None:  # the data.blend rule, said of this field
            c.problems.append(Problem("post.eval_blend", problem.value, problem.rule,
                                      problem.hint.replace("data.blend=", "post.eval_blend=")))
        else:
            from launcher.core.indexed_files import bin_mismatch

            for _, prefix in parse_blend(list(p.eval_blend)):
                why = bin_mismatch(str(prefix))
                c.need(why is None, "post.eval_blend", prefix, f"must name a Megatron .bin/.idx prefix: {why}",
                       "post.eval_blend=[] (the validation split of data.blend)")
    if p.lm_eval_tasks:
        c.need(p.export_hf or p.eval, "post.lm_eval_tasks", list(p.lm_eval_tasks),
               "runs on the exported model, and no post step is on", "post.export_hf=true")
    return c.problems
