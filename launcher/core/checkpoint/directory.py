"""The checkpoint directory, as both wings see it: where it is, whether it takes a file, how big and how slow one
checkpoint is, and which checkpoints in it are complete.

Layout (written by the ranks, ``launcher/rank/checkpoint/store.py``)::

    iter_0000010/        a complete checkpoint: the checkpoint's files + launcher.json (written last)
    iter_0000012.tmp/    a save in progress (ignored)
    latest, LOCK         a hint and the run that owns the directory

Only a directory with ``launcher.json`` (holding ``step`` and ``files``) counts. The login node (the local-run
and validate checks in ``launcher/executor.py``, render's signal lead in ``launcher/render.py`` and
``launcher/core/signal_lead.py``) and the ranks read every fact here from this one module. What rank 0 does to
the directory's files (publish a save, verify, prune, set aside, choose what to resume from) is here too, as
plain file operations; the ranks' ``launcher/rank/checkpoint/store.py`` keeps only what needs torch: Megatron's save
and load, the collectives that make every rank agree, and the lock.

Standard library only (``launcher.core``).
"""
from __future__ import annotations

import datetime
import errno
import json
import math
import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import List, Optional, Tuple

from launcher.core.paths import absolute
from launcher.core.run_identity import identity_diff, run_hash
from launcher.core.checkpoint.weights import continue_hint, weights_diff, weights_mismatch

MANIFEST = "launcher.json"
"""Written last into a checkpoint: step, run identity and hash, every file's size (and CRC32), save time."""
LATEST = "latest"
"""A text file naming the newest complete checkpoint, replaced after each save (a hint: resume lists the dir)."""


def checkpoint_name(step: int) -> str:
    """The directory of step's checkpoint (``iter_0000010``); a save writes into ``<name>.tmp`` first."""
    return f"iter_{step:07d}"


def checkpoint_dir(configured: Optional[str], bundle: Path) -> Path:
    """``checkpoint.dir`` (a relative one against this process's working directory, launcher/core/paths.py;
    the bundle's config.yaml holds it absolute), else the bundle's own ``checkpoints/``."""
    return Path(absolute(configured)) if configured else Path(bundle) / "checkpoints"


# ---- can it take a checkpoint? -----------------------------------------------------------------------------

def nearest_existing(target: Path) -> Path:
    """``target`` or its nearest existing parent (the directory a not yet created checkpoint dir lands in)."""
    probe = Path(target)
    while probe != probe.parent:
        try:
            os.stat(probe)
            break
        except OSError:  # missing, or a name too long to exist (ENAMETOOLONG; validation names it)
            probe = probe.parent
    return probe


def write_probe(directory: Path) -> Optional[str]:
    """Write, fsync and remove a 4 KiB file in ``directory``: why it takes no file, or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return f"{directory} is not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".launcher-probe-") as fh:
            fh.write(b"\0" * 4096)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            return f"no space left on device ({directory})"
        return f"not writable (a test file in {directory}: {exc.strerror or exc})"
    return None


def space_problem(directory: Path, need_bytes: float) -> Optional[str]:
    """Why ``directory``'s file system has no room for ``need_bytes``, or None."""
    free = shutil.disk_usage(directory).free
    if free >= need_bytes:
        return None
    return f"not enough space for a checkpoint: {free / 1e9:.3g} GB free, one needs about {need_bytes / 1e9:.3g} GB"


def dir_error(ckpt_dir: Path, exc: BaseException) -> str:
    """One line for an error creating or writing into the checkpoint dir (full disk, not writable, other)."""
    if getattr(exc, "errno", None) == errno.ENOSPC:
        return f"checkpoint.dir={ckpt_dir}: no space left on device"
    return f"checkpoint.dir={ckpt_dir} is not writable: {exc.strerror or exc}" if isinstance(exc, OSError) \
        else f"checkpoint.dir={ckpt_dir}: {exc}"


def mentions_enospc(exc: BaseException) -> bool:
    """A full disk anywhere in an exception's chain (dist_checkpointing wraps the worker's OSError)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "errno", None) == errno.ENOSPC or "No space left on device" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


# ---- how big, how slow -------------------------------------------------------------------------------------

def bytes_per_param(element_size: int, *, fp32: bool) -> int:
    """One parameter's bytes in a checkpoint with Adam: the weight in its dtype, an fp32 main copy unless the
    weight is fp32, and two fp32 moments (14 bytes in bf16/fp16, 12 in fp32)."""
    return element_size + 8 + (0 if fp32 else 4)


def estimated_bytes(params: float, dtype: str) -> float:
    """The planner's size of one checkpoint: ``params`` parameters of ``precision.dtype`` (the ranks count their
    own shards with ``bytes_per_param``)."""
    fp32 = dtype == "fp32"
    return params * bytes_per_param(4 if fp32 else 2, fp32=fp32)


def estimated_save_s(params: float, dtype: str, *, nodes: int, write_gbps: float) -> float:
    """The planner's save time: checkpoint bytes over the nodes' aggregate write bandwidth. Saves are fully
    parallel over DP (launcher/rank/checkpoint/store.py save_strategy, Megatron-LM's default), so every node writes
    about an even share; the ranks refine this with the busiest node's bytes (``node_save_s``)."""
    return estimated_bytes(params, dtype) / (max(nodes, 1) * write_gbps * 1e9)


def async_save_costs(params: float, dtype: str, *, nodes: int, gpus_per_node: int, write_gbps: float) -> dict:
    """What checkpoint.async_save trades (the planner's, stated per save): the save time hidden from training
    (``estimated_save_s``: the ranks no longer wait for the write) for host memory: each rank stages a copy of the
    shards it writes in host memory and keeps it until its writer has finished (Megatron-Core's async save:
    ``FileSystemWriterAsync.preload_tensors`` copies them to CPU, dist_checkpointing/strategies/filesystem_async.py;
    on CPU, fork's copy-on-write pages, up to the same bytes as training rewrites the weights). Under fully parallel
    save the shards are spread about evenly over the ranks, so a rank holds about the checkpoint's bytes over the
    world size, a node about its bytes over the nodes."""
    total = estimated_bytes(params, dtype)
    world = max(nodes, 1) * max(gpus_per_node, 1)
    return {"bytes": total, "save_s": estimated_save_s(params, dtype, nodes=nodes, write_gbps=write_gbps),
            "hidden_s": estimated_save_s(params, dtype, nodes=nodes, write_gbps=write_gbps),
            "host_bytes_per_rank": total / world, "host_bytes_per_node": total / max(nodes, 1)}


def node_save_s(node_bytes: float, *, write_gbps: float) -> float:
    """The ranks' save time before any save was measured: a save ends when the node writing most has written
    its bytes (``node_bytes``, counted per rank under fully parallel save) at ``cluster.checkpoint_write_gbps``."""
    return max(node_bytes, 0.0) / (write_gbps * 1e9)


# ---- what is in it -----------------------------------------------------------------------------------------

def read_manifest(path: Path) -> Optional[dict]:
    """A checkpoint's ``launcher.json``, or None (absent or unreadable)."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def complete_checkpoints(ckpt_dir: Path) -> List[Tuple[Path, dict]]:
    """(path, manifest) of every complete checkpoint under ckpt_dir, newest (highest step) first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.glob("iter_*"):
        if path.name.endswith(".tmp") or not path.is_dir():
            continue
        manifest = read_manifest(path)
        if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) and "step" in manifest:
            found.append((path, manifest))
    return sorted(found, key=lambda pm: int(pm[1]["step"]), reverse=True)


def latest_checkpoint(ckpt_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint (by step; ``latest`` is only a hint written after each save)."""
    found = complete_checkpoints(ckpt_dir)
    return found[0][0] if found else None


def measured_save_s(ckpt_dir: Path) -> Optional[tuple]:
    """(save seconds, checkpoint path) of the newest complete checkpoint in ``ckpt_dir`` that recorded its save
    time (``save_seconds``), or None."""
    try:
        found = complete_checkpoints(ckpt_dir)
    except OSError:
        return None
    for path, manifest in found:
        seconds = manifest.get("save_seconds")
        if isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0:
            return float(seconds), path
    return None


def crc32(path: Path) -> int:
    """zlib CRC32 of a file, read in 4 MiB blocks."""
    crc = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            crc = zlib.crc32(block, crc)
    return crc


def files_of(path: Path) -> List[str]:
    """A checkpoint's files (relative paths, sorted), the manifest left out."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != MANIFEST)


def verify_files(path: Path, manifest: dict, *, checksum: bool, rank: int = 0, world: int = 1) -> List[str]:
    """This rank's share (every world-th file) of the checks: present, recorded size, CRC32 if asked."""
    problems = []
    for i, (rel, rec) in enumerate(sorted(manifest["files"].items())):
        if i % world != rank:
            continue
        file = Path(path) / rel
        try:
            size = file.stat().st_size
        except OSError:
            problems.append(f"{rel} is missing")
            continue
        if size != rec["size"]:
            problems.append(f"{rel} has {size} bytes, {rec['size']} were written")
        elif checksum and rec.get("crc32") is not None and crc32(file) != rec["crc32"]:
            problems.append(f"{rel} fails its CRC32 check")
    return problems


def own_crcs(tmp: Path, *, checksum: bool, rank: int) -> dict:
    """CRC32 of the files ``rank`` wrote (torch_dist names them __<rank>_<n>.distcp); rank 0 adds the rest."""
    if not checksum:
        return {}
    out = {}
    for rel in files_of(tmp):
        name = Path(rel).name
        mine = name.startswith(f"__{rank}_") if name.endswith(".distcp") else rank == 0
        if mine:
            out[rel] = crc32(tmp / rel)
    return out


# ---- writing it (rank 0) ---------------------------------------------------------------------------------

def publish(ckpt_dir: Path, tmp: Path, final: Path, *, step: int, identity: dict, crcs: list,
             seconds: float, rng: list, optimizer_format: str, fmt: str, extra: Optional[dict] = None) -> None:
    """Rank 0, once every rank has written into ``tmp``: the manifest last (it makes the directory a checkpoint),
    then the rename to ``final``, then ``latest``; a crash in between leaves an ignored partial directory.
    ``extra``: more of the run's state for the manifest (the loss-spike rule's window and skips)."""
    merged = {k: v for part in crcs for k, v in part.items()}
    files = {rel: {"size": (tmp / rel).stat().st_size, "crc32": merged.get(rel)} for rel in files_of(tmp)}
    manifest = {"step": step, "run": run_hash(identity), "identity": identity, "files": files, "rng_layout": rng,
                "optimizer_format": optimizer_format, "format": fmt,
                "saved_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "save_seconds": round(seconds, 3), **(extra or {})}
    write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(final, ignore_errors=True)  # only ever one of this run's own (checked by the caller)
    os.replace(tmp, final)
    write_synced(ckpt_dir / (LATEST + ".tmp"), final.name + "\n")
    os.replace(ckpt_dir / (LATEST + ".tmp"), ckpt_dir / LATEST)


def write_synced(path: Path, text: str) -> None:
    """Write and fsync (the manifest and ``latest`` must be on disk before the rename that publishes)."""
    with open(path, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def prune(ckpt_dir: Path, keep_last: Optional[int], run: str) -> None:
    """Delete this run's oldest complete checkpoints beyond keep_last; never the newest, never another run's,
    never a partial directory (those are not counted either)."""
    if not keep_last:
        return
    own = [path for path, manifest in complete_checkpoints(ckpt_dir) if manifest.get("run") == run]
    for old in own[max(1, keep_last):]:
        shutil.rmtree(old, ignore_errors=True)


def set_aside(ckpt_dir: Path, run: str) -> List[Path]:
    """checkpoint.resume=false: move this run's existing checkpoints out of the way (renamed, not deleted), so
    that a later resume cannot pick an old, higher-step checkpoint over the new run's."""
    moved = []
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    for path, manifest in complete_checkpoints(ckpt_dir):
        if manifest.get("run") == run:
            target = path.with_name(f"superseded-{stamp}-{path.name}")
            os.replace(path, target)
            moved.append(target)
    (Path(ckpt_dir) / LATEST).unlink(missing_ok=True)
    return moved


# ---- what to resume from ----------------------------------------------------------------------------------

def is_dcp_only(path: Path) -> bool:
    """A torch.distributed.checkpoint directory that dist_checkpointing did not write (no metadata.json): how an
    fsdp_dtensor checkpoint without our manifest (Megatron-LM's) looks."""
    return (Path(path) / ".metadata").is_file() and not (Path(path) / "metadata.json").is_file()


def plan_resume(ckpt_dir: Path, identity: dict, load_from: Optional[str]) -> dict:
    """Rank 0: the checkpoints to try, newest first (``{"candidates": [(path, manifest)], "source": "dir" |
    "load"}``), or the one-line reason to stop (``{"error": ...}``): this run's own checkpoints, else
    ``checkpoint.load``'s, else nothing to resume; another run's or another model's checkpoints, or some without a
    manifest, in checkpoint.dir stop the run rather than being overwritten."""
    run = run_hash(identity)
    found = complete_checkpoints(ckpt_dir)
    own = [(str(p), m) for p, m in found if m.get("run") == run]
    if own:
        return {"candidates": own, "source": "dir"}
    if load_from:
        src = Path(load_from)
        if read_manifest(src) is not None:
            return {"candidates": [(str(src), read_manifest(src))], "source": "load"}
        if (src / "metadata.json").is_file():  # named explicitly: a dist_checkpointing checkpoint without our
            return {"candidates": [(str(src), {"files": {}, "step": None})], "source": "load"}  # manifest
        listed = [(str(p), m) for p, m in complete_checkpoints(src)]
        if not listed:
            return {"error": f"checkpoint.load={load_from}: no complete checkpoint there (a directory with "
                             f"{MANIFEST}, or a checkpoint dir holding some)"}
        return {"candidates": listed, "source": "load"}
    if found:
        path, manifest = found[0]
        if weights_mismatch(manifest, identity):  # checkpoint.load= would only fail on the first tensor
            return {"error": f"checkpoint.dir={ckpt_dir} holds checkpoints of another model ({path.name}: "
                             f"{'; '.join(weights_diff(manifest, identity))}): their weights cannot be loaded into "
                             f"this one; use another checkpoint.dir, or set {continue_hint(manifest, identity)} to "
                             "continue that run"}
        return {"error": f"checkpoint.dir={ckpt_dir} holds checkpoints of another run ({path.name}: "
                         f"{identity_diff(manifest.get('identity', {}), identity)}); use checkpoint.load={path} to "
                         "start from it, or another checkpoint.dir"}
    legacy = [p for p in Path(ckpt_dir).glob("iter_*") if (p / "metadata.json").is_file() and not p.name.endswith(".tmp")
              and read_manifest(p) is None] if Path(ckpt_dir).is_dir() else []
    if legacy:
        return {"error": f"checkpoint.dir={ckpt_dir} holds checkpoints without {MANIFEST} (incomplete, or written "
                         f"by another tool), e.g. {sorted(legacy)[-1].name}; use checkpoint.load=<one of them> to "
                         "start from it, or checkpoint.resume=false to start fresh"}
    return {"candidates": [], "source": "dir"}
