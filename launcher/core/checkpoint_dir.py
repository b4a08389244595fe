"""The checkpoint directory, as both wings see it: where it is, whether it takes a file, how big and how slow one
checkpoint is, and which checkpoints in it are complete.

Layout (written by the ranks, ``launcher/rank/checkpoint.py``)::

    iter_0000010/        a complete checkpoint: the checkpoint's files + launcher.json (written last)
    iter_0000012.tmp/    a save in progress (ignored)
    latest, LOCK         a hint and the run that owns the directory

Only a directory with ``launcher.json`` (holding ``step`` and ``files``) counts. The login node (the local-run
and validate checks in ``launcher/executor.py``, render's signal lead in ``launcher/render.py`` and
``launcher/core/signal_lead.py``) and the ranks read every fact here from this one module.

Standard library only (``launcher.core``).
"""
from __future__ import annotations

import errno
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

from launcher.core.paths import absolute

MANIFEST = "launcher.json"
"""Written last into a checkpoint: step, run identity and hash, every file's size (and CRC32), save time."""


def checkpoint_dir(configured: Optional[str], bundle: Path) -> Path:
    """``checkpoint.dir`` (a relative one against this process's working directory, launcher/core/paths.py;
    the bundle's config.yaml holds it absolute), else the bundle's own ``checkpoints/``."""
    return Path(absolute(configured)) if configured else Path(bundle) / "checkpoints"


# ---- can it take a checkpoint? -----------------------------------------------------------------------------

def nearest_existing(target: Path) -> Path:
    """``target`` or its nearest existing parent (the directory a not yet created checkpoint dir lands in)."""
    probe = Path(target)
    while not probe.exists() and probe != probe.parent:
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
    parallel over DP (launcher/rank/checkpoint.py save_strategy, Megatron-LM's default), so every node writes
    about an even share; the ranks refine this with the busiest node's bytes (``node_save_s``)."""
    return estimated_bytes(params, dtype) / (max(nodes, 1) * write_gbps * 1e9)


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
