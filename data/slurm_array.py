"""Preprocessing as a Slurm job array: ``python -m data.preprocess ... --slurm``.

    PREFIX.manifest.json   inputs -> shards (and, once finished, tokens and documents per shard)
    PREFIX-00000-of-00008.bin/.idx, ...   one pair per array task, written atomically by data.preprocess
    PREFIX.blend.json      [weight, prefix, ...] weighted by tokens: give it to data.blend as it is
    PREFIX.slurm/          array.sbatch, finalize.sbatch, done/NNNNN.json (one per finished task), logs/

Flow: the inputs are grouped, in their sorted order, into shards of about ``--shard-size-mb`` bytes on disk (a
file is never split, so a file larger than that is a shard alone). ``array.sbatch`` runs one shard per array
task (``--task-index``), retrying a failed attempt up to ``--retries`` times inside the task; each finished
task leaves a done record. ``finalize.sbatch`` depends on the array (afterany, so it also runs, and says what
is missing, when a task failed): it checks every shard with the pre-flight's header, size and max-id checks,
fills the token counts into the manifest and writes the blend. Running the same command again reuses the
manifest, submits only the shards without a valid done record, and a new final step.

Rendering follows the training bundle's rules: every value that reaches the shell goes through shlex.quote;
``#SBATCH`` values are refused when they hold whitespace or shell metacharacters; with a container image every
path the job reads or writes must lie under one of ``--container-mounts`` (mounted at the same path); secrets
are passed by name only (checked present at run time, never written). No torch import on this path.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = "preprocess_array.sbatch.j2"
SETTINGS = ("tokenizer", "append_eod", "json_key", "eod_token", "chunk_mb", "backend", "cache_budget_mb", "workers")
"""What a task needs to tokenise its shard the same way as every other (stored in the manifest)."""
_SAFE_DIRECTIVE = re.compile(r"^[A-Za-z0-9_.:,=@%/+-]*$")


class ArrayError(SystemExit):
    """A refused plan or render: the message names the option, the value and what to do."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")


# --- planning ------------------------------------------------------------------------------------------


def group_by_bytes(paths: Sequence[str], target_bytes: int) -> List[List[str]]:
    """Consecutive groups of files of about target_bytes each (sizes on disk; files are never split)."""
    groups: List[List[str]] = []
    current: List[str] = []
    size = 0
    for path in paths:
        n = os.path.getsize(path)
        if current and size + n > target_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(path)
        size += n
    if current:
        groups.append(current)
    return groups


def shard_prefix(output_prefix: str, index: int, count: int) -> str:
    return f"{output_prefix}-{index:05d}-of-{count:05d}"


def paths_of(output_prefix: str) -> dict:
    state = Path(output_prefix + ".slurm")
    return {"manifest": Path(output_prefix + ".manifest.json"), "blend": Path(output_prefix + ".blend.json"),
            "state": state, "done": state / "done", "logs": state / "logs",
            "array": state / "array.sbatch", "finalize": state / "finalize.sbatch"}


OUTPUT_SETTINGS = ("append_eod", "json_key", "eod_token")
"""Settings that change the tokens (with the tokenizer file's bytes); the others only change speed."""


def _fingerprint(shards: list, settings: dict) -> str:
    """Names what the shards hold: the grouped inputs (path, size, mtime), the tokenizer's bytes and the
    settings that change tokens. Workers, block size or backend may differ between submissions."""
    with open(settings["tokenizer"], "rb") as f:
        tok = hashlib.sha256(f.read()).hexdigest()
    key = json.dumps([[[i["path"], i["bytes"], i["mtime_ns"]] for i in s["inputs"]] for s in shards]
                     + [tok, {k: settings[k] for k in OUTPUT_SETTINGS}], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def plan(inputs: List[str], output_prefix: str, settings: dict, *, shard_bytes: int) -> dict:
    """The manifest for these inputs (not yet written)."""
    output_prefix = os.path.abspath(output_prefix)
    groups = group_by_bytes([os.path.abspath(p) for p in inputs], shard_bytes)
    shards = []
    for i, group in enumerate(groups):
        files = [{"path": p, "bytes": os.path.getsize(p), "mtime_ns": os.stat(p).st_mtime_ns} for p in group]
        shards.append({"index": i, "prefix": shard_prefix(output_prefix, i, len(groups)), "inputs": files,
                       "bytes": sum(f["bytes"] for f in files), "documents": None, "tokens": None})
    settings = dict(settings, tokenizer=os.path.abspath(settings["tokenizer"]))
    return {"version": 1, "output_prefix": output_prefix, "settings": settings, "shard_bytes": shard_bytes,
            "fingerprint": _fingerprint(shards, settings), "shards": shards}


def load_or_create_manifest(new: dict) -> dict:
    """The manifest on disk when it describes the same inputs and settings, else the new one (written).

    A manifest for other inputs at the same prefix is refused: mixing shards of two corpora would be silent.
    """
    path = paths_of(new["output_prefix"])["manifest"]
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("fingerprint") != new["fingerprint"]:
            raise ArrayError(f"{path} describes other inputs or settings (files added, changed or regrouped); "
                             "use a new --output-prefix, or remove that manifest and its shards to start over")
        return old
    write_json(path, new)
    return new


def write_json(path: Path, obj, *, one_line: bool = False) -> None:
    """Atomic: a temporary sibling renamed over the target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=None if one_line else 1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def done_record(manifest: dict, index: int) -> Optional[dict]:
    """A task's record when its shard is complete on disk (record present, files the sizes it recorded)."""
    path = paths_of(manifest["output_prefix"])["done"] / f"{index:05d}.json"
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    prefix = manifest["shards"][index]["prefix"]
    try:
        ok = (os.path.getsize(prefix + ".bin") == rec["bin_bytes"]
              and os.path.getsize(prefix + ".idx") == rec["idx_bytes"]
              and rec.get("fingerprint") == manifest["fingerprint"])
    except OSError:
        return None
    return rec if ok else None


def pending(manifest: dict) -> List[int]:
    return [s["index"] for s in manifest["shards"] if done_record(manifest, s["index"]) is None]


# --- one task ------------------------------------------------------------------------------------------


def run_task(manifest_path: str, index: Optional[int], *, light_import: bool = False) -> int:
    """Tokenise one shard (array task ``index``, default $SLURM_ARRAY_TASK_ID); skips a completed shard.
    ``light_import`` only from the command's own process (``python -m data.preprocess --manifest``): it leaves
    ``megatron.core`` as a bare namespace package, which breaks any later full use of Megatron in that process."""
    from data.corpus import preprocess

    manifest = json.loads(Path(manifest_path).read_text())
    if index is None:
        if "SLURM_ARRAY_TASK_ID" not in os.environ:
            raise ArrayError("--task-index not given and SLURM_ARRAY_TASK_ID is not set")
        index = int(os.environ["SLURM_ARRAY_TASK_ID"])
    if not 0 <= index < len(manifest["shards"]):
        raise ArrayError(f"--task-index {index}: the manifest has shards 0..{len(manifest['shards']) - 1}")
    if done_record(manifest, index) is not None:
        print(f"shard {index}: already complete, skipped")
        return 0
    shard, st = manifest["shards"][index], manifest["settings"]
    stats = preprocess([i["path"] for i in shard["inputs"]], st["tokenizer"], shard["prefix"], workers=st["workers"],
                       append_eod=st["append_eod"], json_key=st["json_key"], chunk_mb=st["chunk_mb"],
                       backend=st["backend"], eod_token=st["eod_token"], cache_budget_mb=st["cache_budget_mb"],
                       quiet=True, light_import=light_import, allow_empty=True)
    rec = {"index": index, "prefix": shard["prefix"], "documents": stats["documents"], "tokens": stats["tokens"],
           "vocab_size": stats["vocab_size"], "seconds": round(stats["seconds"], 3),
           "bin_bytes": os.path.getsize(shard["prefix"] + ".bin"),
           "idx_bytes": os.path.getsize(shard["prefix"] + ".idx"),
           "fingerprint": manifest["fingerprint"], "host": os.uname().nodename,
           "job": f"{os.environ.get('SLURM_ARRAY_JOB_ID', '-')}_{os.environ.get('SLURM_ARRAY_TASK_ID', '-')}"}
    write_json(paths_of(manifest["output_prefix"])["done"] / f"{index:05d}.json", rec)
    print(f"shard {index}: wrote {shard['prefix']}.bin/.idx: {stats['documents']:,} documents, "
          f"{stats['tokens']:,} tokens in {stats['seconds']:.1f} s")
    return 0


# --- the final step ------------------------------------------------------------------------------------


def finalize(manifest_path: str) -> int:
    """Check every shard (pre-flight's header, size and max-id checks); write token counts and the blend."""
    from launcher.data_preflight import check_prefix

    manifest = json.loads(Path(manifest_path).read_text())
    lines, problems = [], []
    for shard in manifest["shards"]:
        rec = done_record(manifest, shard["index"])
        if rec is None:
            lines.append(f"shard {shard['index']}: not complete ({shard['prefix']})")
            continue
        found: list = []
        tokens = check_prefix(f"shard[{shard['index']}]", shard["prefix"], shard["prefix"], rec["vocab_size"], found)
        if tokens is not None and tokens != rec["tokens"]:
            lines.append(f"shard {shard['index']}: index holds {tokens:,} tokens, its task recorded {rec['tokens']:,}")
        problems += [p for p in found if p.severity == "error"]
        shard.update(documents=rec["documents"], tokens=rec["tokens"])
    lines += [p.line() for p in problems]
    if lines:
        print("preprocess: final check failed:\n  " + "\n  ".join(lines), file=sys.stderr)
        print(f"preprocess: run the same `python -m data.preprocess ... --slurm` command again: it resubmits only "
              f"the {len(pending(manifest))} incomplete shard(s)", file=sys.stderr)
        return 1
    total = sum(s["tokens"] for s in manifest["shards"])
    blend: list = []
    for s in manifest["shards"]:
        if s["tokens"]:  # an empty shard cannot carry a weight (weights must be > 0)
            blend += [s["tokens"] / total, s["prefix"]]
    manifest.update(tokens=total, documents=sum(s["documents"] for s in manifest["shards"]),
                    blend=str(paths_of(manifest["output_prefix"])["blend"]))
    write_json(Path(manifest_path), manifest)
    # One line, so that `"data.blend=$(cat PREFIX.blend.json)"` is a launcher override as it stands.
    write_json(paths_of(manifest["output_prefix"])["blend"], blend, one_line=True)
    print(f"preprocess: all {len(manifest['shards'])} shards checked: {manifest['documents']:,} documents, "
          f"{total:,} tokens; blend written to {manifest['blend']}")
    return 0


# --- rendering and submission --------------------------------------------------------------------------


def _directive(option: str, value) -> str:
    value = "" if value is None else str(value)
    if not _SAFE_DIRECTIVE.match(value):
        raise ArrayError(f"{option}={value!r}: a #SBATCH value may hold only letters, digits and _.:,=@%/+-")
    return value


def _mounted(path: str, mounts: Sequence[str]) -> bool:
    for m in mounts:
        src, _, rest = m.partition(":")
        dst = rest.split(":")[0] if rest else src
        if src == dst and (path == dst or path.startswith(dst.rstrip("/") + "/")):
            return True
    return False


def check_mounts(manifest: dict, workdir: str, mounts: Sequence[str]) -> None:
    """With a container, every path the job touches must be mounted at the same path inside it."""
    needed = {workdir, os.path.dirname(manifest["output_prefix"]), manifest["settings"]["tokenizer"]}
    needed.update(os.path.dirname(i["path"]) for s in manifest["shards"] for i in s["inputs"])
    missing = sorted(p for p in needed if not _mounted(p, mounts))
    if missing:
        raise ArrayError(f"--container-mounts {','.join(mounts) or '(none)'} does not mount {missing[0]}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                         + f"; add {missing[0]}:{missing[0]} or a directory above it")


def render(manifest: dict, opts: dict) -> dict:
    """The two batch scripts' texts (pure, for golden tests): {'array': ..., 'finalize': ...}."""
    from jinja2 import Environment, FileSystemLoader, StrictUndefined

    env = Environment(loader=FileSystemLoader(str(ROOT / "slurm")), undefined=StrictUndefined,
                      keep_trailing_newline=True, autoescape=False)
    env.filters["q"] = lambda value: shlex.quote(str(value))
    for name in opts.get("secret_env", []):
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
            raise ArrayError(f"--secret-env {name!r}: a secret is named by its environment variable")
    mounts = [m for m in (opts.get("container_mounts") or "").split(",") if m]
    workdir = opts.get("workdir") or str(ROOT)
    if opts.get("container_image"):
        check_mounts(manifest, workdir, mounts)
    p = paths_of(manifest["output_prefix"])
    ctx = {"manifest": str(p["manifest"]), "logs": _directive("--output-prefix (its logs directory)", p["logs"]),
           "job_name": _directive("--job-name", opts.get("job_name") or "preprocess"),
           "time": _directive("--time", opts.get("time", "04:00:00")),
           "partition": _directive("--partition", opts.get("partition")),
           "account": _directive("--account", opts.get("account")),
           "mem": _directive("--mem", opts.get("mem")),
           "cpus": int(opts.get("cpus_per_task") or manifest["settings"]["workers"]),
           "extra_args": [_directive("--sbatch-arg", a) for a in opts.get("sbatch_args", [])],
           # In a container the login node's interpreter path means nothing: the image's python then.
           "python": opts.get("python") or ("python" if opts.get("container_image") else sys.executable),
           "workdir": workdir,
           "retries": int(opts.get("retries", 2)), "shards": len(manifest["shards"]),
           "container_image": opts.get("container_image") or "", "container_mounts": ",".join(mounts),
           "secret_names": list(opts.get("secret_env", []))}
    tpl = env.get_template(TEMPLATE)
    return {"array": tpl.render(final=False, **ctx), "finalize": tpl.render(final=True, **ctx)}


def _array_spec(indices: List[int], max_parallel: int) -> str:
    runs, start = [], None
    for i, n in enumerate(indices):
        if start is None:
            start = n
        if i + 1 == len(indices) or indices[i + 1] != n + 1:
            runs.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ",".join(runs) + (f"%{max_parallel}" if max_parallel > 0 else "")


def _refuse_while_active(log: Path) -> None:
    """A resubmission while the previous array or final step is still queued or running would run a shard
    twice; refuse and name the jobs."""
    try:
        last = json.loads(log.read_text().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return
    ids = [j for j in (last.get("array_job"), last.get("final_job")) if j]
    if not ids:
        return
    proc = subprocess.run(["squeue", "-h", "-o", "%i %T", "-j", ",".join(ids)], capture_output=True, text=True,
                          timeout=60)
    active = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode == 0 and active:
        raise ArrayError(f"the previous submission is still queued or running ({'; '.join(active[:4])}); wait for "
                         f"its final step, or scancel {' '.join(ids)}, then run this command again")


def _sbatch(args: List[str]) -> str:
    proc = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        why = proc.stderr.strip() or proc.stdout.strip()
        raise ArrayError(f"sbatch {' '.join(map(shlex.quote, args))} failed: {why}")
    return proc.stdout.strip().split(";")[0]


def submit(inputs: List[str], output_prefix: str, settings: dict, opts: dict, *, shard_bytes: int,
           render_only: bool = False, argv: Optional[List[str]] = None) -> dict:
    """Plan (or reuse the manifest), render both scripts, submit the pending shards and the final step."""
    manifest = load_or_create_manifest(plan(inputs, output_prefix, settings, shard_bytes=shard_bytes))
    p = paths_of(manifest["output_prefix"])
    texts = render(manifest, opts)
    p["logs"].mkdir(parents=True, exist_ok=True)
    p["done"].mkdir(parents=True, exist_ok=True)
    for key in ("array", "finalize"):
        write_text(p[key], texts[key])
    todo = pending(manifest)
    out = {"manifest": str(p["manifest"]), "shards": len(manifest["shards"]), "pending": todo,
           "array_script": str(p["array"]), "finalize_script": str(p["finalize"]), "array_job": None, "final_job": None}
    array_args = [f"--array={_array_spec(todo, int(opts.get('max_parallel') or 0))}", str(p["array"])] if todo else None
    if not render_only:
        _refuse_while_active(p["state"] / "submissions.jsonl")
    if render_only:
        out["commands"] = ([["sbatch", *array_args]] if todo else []) + [
            ["sbatch", "--dependency=afterany:<array job>" if todo else "", str(p["finalize"])]]
        return out
    if todo:
        out["array_job"] = _sbatch(array_args)
    out["final_job"] = _sbatch(([f"--dependency=afterany:{out['array_job']}"] if todo else []) + [str(p["finalize"])])
    with open(p["state"] / "submissions.jsonl", "a") as f:
        f.write(json.dumps({"array_job": out["array_job"], "final_job": out["final_job"], "pending": todo,
                            "argv": argv or []}) + "\n")
    return out


def write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
