"""Before the GPUs are spent: what a checkpoint is (``python -m launcher checkpoint-info DIR``) and whether this
job can continue from it (the resume plan that ``action=validate`` and ``action=plan`` print, and every action
that prepares a run refuses with one line, exit 2, before anything renders).

Everything is read from the checkpoint's own metadata: our manifest ``launcher.json`` (step, the saving run's
identity: model, layout, batch; ``rng_layout`` (PP, TP, DP), ``format``, ``optimizer_format``), the directory's
files (present, recorded sizes). The consumed samples live in the checkpoint's common state (a
torch.distributed.checkpoint entry): reading them needs torch, so ``checkpoint-info`` reads them in a process of its
own (``launcher/checkpoint_state.py``); the resume plan, which validate and plan print in about a second, derives
them from the manifest (``consumed_of``) and says so.

The verdict walks the ranks' own resume (``launcher/rank/checkpoint/store.py`` resume) over the same functions:
``plan_resume`` (which checkpoints, this run's or ``checkpoint.load``'s; another run's or another model's in
``checkpoint.dir`` stop the run), ``verify_files`` (a damaged candidate is skipped: the ranks fall back to the
previous one), ``weights_mismatch``, ``conversion_refusal`` and ``dp_refusal`` (``launcher/core/checkpoint/resume_rules.py``).
Login-node module: no torch, no megatron.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

from launcher.core import Layout
from launcher.core.checkpoint import directory as cdir
from launcher.core.checkpoint import resume_rules as rules
from launcher.core.checkpoint.format import checkpoint_format
from launcher.core.paths import absolute
from launcher.core.run_identity import identity_diff, run_hash, run_identity
from launcher.core.checkpoint.weights import continue_hint, weights_diff, weights_of
from launcher.problems import Problem
from launcher.schema import JobConfig

DIMS = ("TP", "PP", "VPP", "EP", "CP", "DP")


# ---- what a checkpoint is ----------------------------------------------------------------------------------

def saved_layout(manifest: dict) -> Optional[dict]:
    """The layout a checkpoint was saved at, from its run identity (and its RNG layout's DP), or None."""
    ident = manifest.get("identity") or {}
    if "parallel.tensor" not in ident:
        return None
    tp, pp, cp = (ident.get(f"parallel.{k}") or 1 for k in ("tensor", "pipeline", "context"))
    world = (ident.get("nodes") or 1) * (ident.get("cluster.gpus_per_node") or 1)
    dp = rules.saved_dp(manifest)
    dp = dp // cp if dp else world // max(1, tp * pp * cp)
    return {"TP": tp, "PP": pp, "VPP": ident.get("parallel.virtual_pipeline") or 1, "EP": ident.get("parallel.expert")
            or 1, "CP": cp, "DP": dp, "sharding": _sharding(ident.get("parallel.megatron_fsdp"),
                                                            ident.get("parallel.distributed_optimizer"))}


def job_layout(job: JobConfig, lay: Layout) -> dict:
    """This job's layout in ``saved_layout``'s terms."""
    return {"TP": lay.tp, "PP": lay.pp, "VPP": lay.vpp, "EP": lay.ep, "CP": lay.cp, "DP": lay.dp,
            "sharding": _sharding(job.parallel.megatron_fsdp, job.parallel.distributed_optimizer)}


def _sharding(fsdp, distopt) -> str:
    return "Megatron-FSDP" if fsdp else "DDP + distributed optimizer" if distopt else "DDP"


def find(path: Path) -> tuple:
    """DIR as given to checkpoint-info: (the checkpoint, its manifest or None, the other complete checkpoints
    beside it, newest first). A directory holding checkpoints stands for its newest complete one."""
    path = Path(path)
    manifest = cdir.read_manifest(path)
    if manifest is not None or (path / "metadata.json").is_file() or (path / ".metadata").is_file():
        others = [p for p, _ in cdir.complete_checkpoints(path.parent) if p.resolve() != path.resolve()]
        return path, manifest, others
    found = cdir.complete_checkpoints(path)
    if not found:
        return None, None, []
    return found[0][0], found[0][1], [p for p, _ in found[1:]]


def read_state(path: Path) -> dict:
    """step and consumed samples from the checkpoint's common state, read in a process of its own (torch)."""
    proc = subprocess.run([sys.executable, "-m", "launcher.checkpoint_state", str(path)], capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"reading its common state failed: {tail[:300]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def consumed_of(manifest: dict) -> Optional[int]:
    """The samples a checkpoint's run had consumed, from its manifest alone: recorded there, else step x the saving
    run's global batch (each step consumes one, a skipped step too: launcher/rank/loop.py). The second is wrong for
    a run that itself started from a checkpoint of another global batch; the checkpoint's own count is exact."""
    if isinstance(manifest.get("consumed_samples"), int):
        return manifest["consumed_samples"]
    gbs = (manifest.get("identity") or {}).get("train.global_batch_size")
    return int(manifest["step"]) * int(gbs) if manifest.get("step") is not None and gbs else None


def checkpoint_info(path: Path, *, read_common: bool = True) -> dict:
    """What checkpoint-info prints (also its --json): model, layout, formats, step, data position, files."""
    ckpt, manifest, others = find(Path(absolute(str(path))))
    if ckpt is None:
        return {"path": str(path), "error": f"no checkpoint there (an iter_N with {cdir.MANIFEST}, a "
                                            "dist_checkpointing directory, or a directory holding them)"}
    manifest = manifest or {}
    ident = manifest.get("identity") or {}
    out = {"path": str(ckpt), "manifest": bool(manifest), "step": manifest.get("step"),
           "format": rules.saved_format(manifest, cdir.is_dcp_only(ckpt)),
           "optimizer_format": (manifest.get("optimizer_format", rules.DEFAULT_OPTIMIZER_FORMAT)
                                if ident.get("parallel.distributed_optimizer") else
                                "per-parameter (no distributed optimizer)" if ident else None),
           "weights_only": bool(manifest.get("weights_only")), "run": manifest.get("run"),
           "saved_utc": manifest.get("saved_utc"), "save_seconds": manifest.get("save_seconds"),
           "layout": saved_layout(manifest), "rng_layout": manifest.get("rng_layout"),
           "model": {"name": ident.get("model.name"), **(manifest.get("weights_of") or weights_of(ident)),
                     "model.seq_length": ident.get("model.seq_length")} if (ident or manifest.get("weights_of"))
           else None,
           "others": [p.name for p in others]}
    gbs = ident.get("train.global_batch_size")
    if gbs:
        out["global_batch_size"], out["micro_batch_size"] = gbs, ident.get("train.micro_batch_size")
    derived = consumed_of(manifest)
    if manifest.get("weights_only"):
        out["consumed_samples"], out["consumed_from"] = 0, "weights only: a run starts at step 0"
    elif read_common or derived is None:
        state = read_state(ckpt)
        out["common_state"] = state
        if "error" not in state:
            out["step"], out["consumed_samples"] = state["step"], state["consumed_samples"]
            out["consumed_from"] = "read from the checkpoint"
            if derived is not None and derived != state["consumed_samples"]:
                out["consumed_from"] += (f"; step x train.global_batch_size would say {derived}: the saving run "
                                         "started from a checkpoint of another global batch")
    if out.get("consumed_samples") is None and derived is not None:
        out["consumed_samples"] = derived
        out["consumed_from"] = ("step x train.global_batch_size, not read from the checkpoint " +
                                ("(--no-state)" if "common_state" not in out else "(reading it failed)"))
    files = manifest.get("files") or {}
    out["files"], out["bytes"] = len(files), sum(int(r.get("size", 0)) for r in files.values())
    out["problems"] = (cdir.verify_files(ckpt, manifest, checksum=False) if manifest else
                       [f"no {cdir.MANIFEST}: written by another tool, or incomplete (its files cannot be checked)"])
    out["complete"] = bool(manifest) and not out["problems"]
    return out


def info_text(info: dict) -> List[str]:
    """checkpoint-info's lines."""
    if "error" in info:
        return [f"{info['path']}: {info['error']}"]
    lay, model = info["layout"], info["model"]
    lines = [f"checkpoint {info['path']}" + (f" ({len(info['others'])} older beside it: "
                                             f"{', '.join(info['others'][:3])}{' ...' if len(info['others']) > 3 else ''})"
                                             if info["others"] else "")]
    lines.append(f"  step: {info['step']}" + (f", saved {info['saved_utc']} in {info['save_seconds']} s"
                                              if info.get("saved_utc") else ""))
    if model:
        shown = ", ".join(f"{k.split('.', 1)[1]}={v}" for k, v in model.items() if k.startswith("model.") and v
                          not in (None, False, 0))
        lines.append(f"  model: {model.get('name') or '?'} ({shown})")
    if lay:
        lines.append("  layout: " + " ".join(f"{d}{lay[d]}" for d in DIMS) + f", {lay['sharding']}")
    lines.append(f"  format: {info['format']}; optimizer state: {info['optimizer_format'] or 'unknown'}"
                 + (" (weights only, import-hf)" if info["weights_only"] else ""))
    if info.get("consumed_samples") is not None:
        batch = (f", global batch {info['global_batch_size']} (micro batch {info['micro_batch_size']})"
                 if info.get("global_batch_size") else "")
        lines.append(f"  data: {info['consumed_samples']} samples consumed ({info['consumed_from']}){batch}; "
                     f"the next step reads from sample {info['consumed_samples']}")
    elif info.get("common_state", {}).get("error"):
        lines.append(f"  data: unknown ({info['common_state']['error']})")
    state = "complete" if info["complete"] else "NOT loadable as is: " + "; ".join(info["problems"][:3])
    lines.append(f"  files: {info['files']} ({info['bytes'] / 1e6:.3g} MB), {state}")
    return lines


def info_main(argv: List[str]) -> int:
    """``python -m launcher checkpoint-info DIR [--json] [--no-state]``."""
    paths = [a for a in argv if not a.startswith("-")]
    unknown = [a for a in argv if a.startswith("-") and a not in ("--json", "--no-state", "-h", "--help")]
    if len(paths) != 1 or unknown or "-h" in argv or "--help" in argv:
        print("usage: python -m launcher checkpoint-info DIR [--json] [--no-state]\n  DIR: a checkpoint (iter_N) "
              "or a checkpoint directory holding them (its newest complete one); step and consumed samples are read "
              "from the checkpoint itself (a process of its own with torch, seconds); --no-state derives them from "
              "launcher.json alone",
              file=sys.stdout if ("-h" in argv or "--help" in argv) and not unknown else sys.stderr)
        return 0 if ("-h" in argv or "--help" in argv) and not unknown else 2
    info = checkpoint_info(Path(paths[0]), read_common="--no-state" not in argv)
    if "error" in info and "--json" not in argv:  # one line on stderr, as every other refusal of the CLI
        print(f"error: {info_text(info)[0]}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=1, default=str) if "--json" in argv else "\n".join(info_text(info)))
    return 2 if "error" in info else 0


# ---- whether this job continues from it --------------------------------------------------------------------

@dataclass
class ResumePlan:
    """What the ranks of this job will do with the checkpoints it is given."""

    verdict: str
    """fresh (nothing to load: step 0), as_is, reshard, convert, weights (import-hf weights only) or refused."""
    checkpoint: Optional[str] = None
    source: str = "dir"
    """dir: this run's own checkpoints in checkpoint.dir; load: checkpoint.load's."""
    step: Optional[int] = None
    consumed: Optional[int] = None
    changes: List[str] = field(default_factory=list)
    """The layout dimensions that change (``TP 2 -> 1``) and the format conversion."""
    notes: List[str] = field(default_factory=list)
    data: List[str] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)
    """Newer candidates the ranks will skip (damaged, or refused), each with why."""
    problem: Optional[Problem] = None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["problem"] = self.problem.line() if self.problem else None
        return out

    def lines(self) -> List[str]:
        head = {"fresh": "starts at step 0 (nothing to resume)", "as_is": "loads as is",
                "reshard": "loads after resharding (" + ", ".join(self.changes) + ")",
                "convert": "loads after a conversion (" + ", ".join(self.changes) + ")",
                "weights": "loads its weights only (import-hf) and starts at step 0",
                "refused": "refused: " + (self.problem.line() if self.problem else "")}[self.verdict]
        where = f"{self.checkpoint} (step {self.step}, {'checkpoint.load' if self.source == 'load' else 'this run'})" \
            if self.checkpoint else ""
        out = [f"resume: {where + ': ' if where else ''}{head}"]
        out += [f"  skipped: {s}" for s in self.skipped]
        out += [f"  {n}" for n in self.notes + self.data]
        return out


def resume_plan(job: JobConfig, lay: Layout) -> Optional[ResumePlan]:
    """The resume plan of a job with ``checkpoint.load`` or ``checkpoint.dir`` set, else None (a new bundle's own
    directory is empty). Paths are the job's (absolute, launcher/core/paths.py)."""
    ck = job.checkpoint
    if not (ck.load or ck.dir) or ck.load_hf:
        return None
    identity = run_identity(job)
    ckpt_dir = Path(absolute(ck.dir)) if ck.dir else Path(absolute(job.output_dir)) / ".no-bundle-yet"
    if not ck.resume:
        return _fresh_start(ckpt_dir, identity)
    try:
        found = cdir.plan_resume(ckpt_dir, identity, absolute(ck.load) if ck.load else None)
    except OSError:
        return None  # unreadable here (another file system): the ranks decide
    if "error" in found and found["error"].startswith("checkpoint.load=") and not Path(absolute(ck.load)).exists():
        return None  # names nothing here: launcher/preflight.py checkpoint_load_problem owns that line (and its hint)
    if "error" in found:
        return ResumePlan("refused", problem=_plan_problem(found["error"], ckpt_dir, ck.load, identity))
    plan = ResumePlan("fresh", source=found["source"])
    for path_s, manifest in found["candidates"]:
        decided = _candidate(job, lay, identity, Path(path_s), manifest, plan)
        if decided is not None:
            return decided
    if plan.skipped:
        what = f"checkpoint.load={ck.load}" if plan.source == "load" else f"checkpoint.dir={ckpt_dir}"
        plan.verdict = "refused"
        plan.problem = plan.problem or Problem(
            "checkpoint.load" if plan.source == "load" else "checkpoint.dir", ck.load or ck.dir,
            f"no checkpoint there loads into this run ({'; '.join(plan.skipped)}) (the ranks stop after building "
            "the model)", f"another checkpoint, or checkpoint.resume=false to start fresh ({what} untouched)"
            if plan.source == "dir" else "another checkpoint of this model")
    return plan


def _fresh_start(ckpt_dir: Path, identity: dict) -> ResumePlan:
    """checkpoint.resume=false (``launcher/rank/checkpoint/store.py`` start_fresh): refused over another run's
    checkpoints, else this run's are moved aside."""
    run = run_hash(identity)
    found = cdir.complete_checkpoints(ckpt_dir)
    foreign = [(p, m) for p, m in found if m.get("run") != run]
    if foreign:
        path, manifest = foreign[0]
        return ResumePlan("refused", problem=Problem(
            "checkpoint.dir", str(ckpt_dir), f"holds checkpoints of another run ({path.name}: "
            f"{identity_diff(manifest.get('identity', {}), identity)}); checkpoint.resume=false would overwrite them",
            "another checkpoint.dir"))
    plan = ResumePlan("fresh")
    if found:
        plan.notes.append(f"checkpoint.resume=false: this run's {len(found)} checkpoint(s) there are moved aside")
    return plan


def _plan_problem(message: str, ckpt_dir: Path, load: Optional[str], identity: dict) -> Problem:
    """plan_resume's refusal as a Problem: the field it names, the rule, its alternative (after ``; ``)."""
    if "checkpoints of another model" in message:
        newest = cdir.complete_checkpoints(ckpt_dir)[0][1]
        hint = continue_hint(newest, identity)
        key = hint.split("=", 1)[0]
        return Problem(key, identity.get(key), f"checkpoint.dir={ckpt_dir} holds checkpoints of another model "
                       f"({'; '.join(weights_diff(newest, identity))}): their weights cannot be loaded into this one",
                       f"{hint} to continue that run, or another checkpoint.dir")
    fld = "checkpoint.load" if message.startswith("checkpoint.load=") else "checkpoint.dir"
    rule, _, hint = message.partition("; ")
    prefix = f"{fld}={load if fld == 'checkpoint.load' else ckpt_dir}"
    rule = rule[len(prefix):].lstrip(": ") if rule.startswith(prefix) else rule
    hint = hint[4:] if hint.startswith("use ") else hint
    return Problem(fld, load if fld == "checkpoint.load" else str(ckpt_dir), rule, hint or "checkpoint.load=null")


def _candidate(job, lay, identity, path: Path, manifest: dict, plan: ResumePlan) -> Optional[ResumePlan]:
    """One candidate, as the ranks try it: the decided plan, or None (skipped: the ranks try the next)."""
    damaged = cdir.verify_files(path, manifest, checksum=False)
    if damaged:
        plan.skipped.append(f"{path.name}: {len(damaged)} damaged file(s): {'; '.join(damaged[:2])}")
        return None
    if plan.source == "load":
        diff = weights_diff(manifest, identity)
        if diff:
            hint = continue_hint(manifest, identity)
            key = hint.split("=", 1)[0]
            return ResumePlan("refused", str(path), plan.source, manifest.get("step"), problem=Problem(
                key, identity.get(key), f"checkpoint.load={path} holds weights of another model ({'; '.join(diff)}):"
                " the ranks refuse it before loading", f"{hint}, or a checkpoint of this model"))
    fmt, saved = checkpoint_format(job), rules.saved_format(manifest, cdir.is_dcp_only(path))
    converted = saved != fmt
    if converted:
        refused = rules.conversion_refusal(path, manifest, saved, identity)
        if refused:
            back = "true" if saved == rules.FSDP else "false"
            return ResumePlan("refused", str(path), plan.source, manifest.get("step"), problem=Problem(
                "parallel.megatron_fsdp", job.parallel.megatron_fsdp, refused.split("; continue it with")[0],
                f"parallel.megatron_fsdp={back}"))
    structure = rules.structure_refusal(manifest, identity, converted=converted)
    if structure:
        key, there, why = structure
        plan.skipped.append(f"{path.name}: {why}")
        if plan.problem is None:
            plan.problem = Problem(key, getattr(getattr(job, key.split(".")[0]), key.split(".")[1]),
                                   f"{path.name}: {why} (the ranks fail to load it after building the model)",
                                   f"{key}={_override(there)}, as saved")
        return None
    dp_here = lay.dp * lay.cp
    refused = rules.dp_refusal(manifest, distributed_optimizer=job.parallel.distributed_optimizer, fmt=fmt,
                               dp_here=dp_here, converted=converted)
    if refused:
        plan.skipped.append(f"{path.name}: {refused.split('; resume at')[0]}")
        if plan.problem is None:
            plan.problem = _dp_problem(job, lay, path, manifest, plan.source)
        return None
    return _loads(job, lay, path, manifest, plan, saved, fmt)


def _override(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _dp_problem(job, lay, path: Path, manifest: dict, source: str) -> Problem:
    """A dp_reshardable optimizer state at another DP: the same rule as the ranks', with a layout that loads it
    (re-validated: the job with that override is valid and has the saved DP)."""
    there = rules.saved_dp(manifest) // max(1, lay.cp)
    fld = "checkpoint.load" if source == "load" else "checkpoint.dir"
    return Problem(fld, job.checkpoint.load if source == "load" else job.checkpoint.dir,
                   f"{path.name}'s distributed-optimizer state was saved with checkpoint.optimizer_format="
                   f"dp_reshardable at DP={there}, this run has DP={lay.dp}: it loads only at DP={there} (the ranks "
                   "refuse it after building the model)",
                   f"{_world_for_dp(job, lay, there) or f'a layout with DP={there}'}, or a checkpoint saved with "
                   "checkpoint.optimizer_format=fully_reshardable")


def _world_for_dp(job, lay, dp: int) -> Optional[str]:
    """The override (nodes, or GPUs per node on one node) that gives this job ``dp`` and validates, or None."""
    import dataclasses

    from launcher.core import derive
    from launcher.validate import check

    world, per_node = dp * lay.tp * lay.pp * lay.cp, job.cluster.gpus_per_node
    tries = [("cluster.gpus_per_node", world)] if job.nodes == 1 else []
    tries += [("nodes", world // per_node)] if world % per_node == 0 else []
    for key, value in tries:
        changed = (dataclasses.replace(job, nodes=value) if key == "nodes" else
                   dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, gpus_per_node=value)))
        try:
            ok = not [p for p in check(changed).problems if p.severity == "error"] and derive(changed).dp == dp
        except Exception:  # noqa: BLE001 - an override that cannot even derive is no alternative
            ok = False
        if ok:
            return f"{key}={value} (DP={dp}, as saved)"
    return None


def _loads(job, lay, path: Path, manifest: dict, plan: ResumePlan, saved: str, fmt: str) -> ResumePlan:
    """The candidate the ranks load: as is, resharded or converted, and what the data loader then reads."""
    plan.checkpoint, plan.step = str(path), manifest.get("step")
    if manifest.get("weights_only"):
        plan.verdict, plan.step, plan.consumed = "weights", 0, 0
        return plan
    theirs, ours = saved_layout(manifest), job_layout(job, lay)
    if theirs:
        plan.changes = [f"{d} {theirs[d]} -> {ours[d]}" for d in DIMS if theirs[d] != ours[d]]
    if saved != fmt:
        plan.changes.append(f"{saved} -> {fmt} ({theirs['sharding'] if theirs else '?'} -> {ours['sharding']}), "
                            "converted in memory on the ranks (launcher/rank/checkpoint/convert.py), then saved as "
                            f"{fmt}")
        plan.verdict = "convert"
    else:
        plan.verdict = "reshard" if plan.changes else "as_is"
    rng = manifest.get("rng_layout")
    if rng and list(rng) != [lay.pp, lay.tp, lay.dp * lay.cp]:
        plan.notes.append(f"the RNG streams start afresh (saved per (PP, TP, DP) = {tuple(rng)}, this run is "
                          f"{(lay.pp, lay.tp, lay.dp * lay.cp)}); weights, optimizer and LR schedule continue")
    if not manifest.get("identity"):
        plan.notes.append(f"no {cdir.MANIFEST} identity: its layout and model are not known here; Megatron's "
                          "dist_checkpointing reshards the weights, a tensor this model lacks fails the load")
    _data_lines(job, lay, manifest, plan)
    return plan


def _data_lines(job, lay, manifest: dict, plan: ResumePlan) -> None:
    """The data loader's consequences: consumed samples kept, where the next step reads, a batch change, a run
    that reads past the samples its data set is built for."""
    ident = manifest.get("identity") or {}
    gbs_there, gbs = ident.get("train.global_batch_size"), job.train.global_batch_size
    if plan.step is None or not gbs_there:
        plan.data.append("data: consumed samples are read by the ranks from the checkpoint (no manifest here)")
        return
    step, mbs = int(plan.step), job.train.micro_batch_size
    plan.consumed = consumed = consumed_of(manifest)
    how = ("" if isinstance(manifest.get("consumed_samples"), int) else
           f" (step {step} x global batch {gbs_there}; checkpoint-info reads the checkpoint's own count)")
    ranks = (f"{lay.dp} DP ranks, rank r from sample {consumed} + {mbs}r, every {mbs * lay.dp}" if lay.dp > 1
             else "one DP rank")
    plan.data.append(f"data: {consumed} samples consumed{how}; step {step + 1} reads samples {consumed}.."
                     f"{consumed + gbs - 1} ({lay.microbatches} micro-batches of {mbs} per DP rank; {ranks})")
    if gbs_there != gbs:
        plan.data.append(f"data: train.global_batch_size {gbs_there} -> {gbs}: the step count continues at {step} "
                         f"(the LR schedule is in steps) and the samples at {consumed}, not at {step} x {gbs}")
    dp_there = (saved_layout(manifest) or {}).get("DP")
    if dp_there and dp_there != lay.dp:
        plan.data.append(f"data: DP {dp_there} -> {lay.dp}: the same global sample order, each step's samples split "
                         f"over {lay.dp} rank(s) instead of {dp_there}")
    here = run_identity(job)
    changed = [k for k in ident if (k.startswith("data.") or k == "train.seed") and ident.get(k) != here.get(k)]
    if changed:
        plan.data.append(f"data: {', '.join(sorted(changed))} changed: the samples from {consumed} on are the new "
                         "setting's, not the ones the saving run would have read")
    if step >= lay.steps:
        plan.data.append(f"data: the checkpoint is at step {step}, this run ends at step {lay.steps}: nothing is left "
                         "to train")
        return
    built, end = lay.steps * gbs, consumed + (lay.steps - step) * gbs
    if end > built:
        plan.data.append(f"data: this run reads up to sample {end}, past the {built} it asks the data set for (train "
                         "steps x global batch): where the data set holds no more, the sampler wraps to sample 0 and "
                         "repeats data (launcher/rank/data.py MicroBatchSampler)")


def problems_for(job: JobConfig, lay: Optional[Layout]) -> List[Problem]:
    """The resume plan's refusal as the action's problem (none when it loads, or cannot be judged here)."""
    if lay is None:
        return []
    plan = resume_plan(job, lay)
    return [plan.problem] if plan is not None and plan.verdict == "refused" and plan.problem else []


def print_plan(job: JobConfig, lay: Optional[Layout], out=None) -> None:
    """``action=validate`` / ``action=plan``: the resume plan's lines, when the job names checkpoints."""
    plan = resume_plan(job, lay) if lay is not None else None
    if plan is not None:
        print("\n".join(plan.lines()), file=out or sys.stdout)
