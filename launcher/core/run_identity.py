"""Which runs are the same run: the config values a checkpoint records as its run's identity, and its hash.

A run continues only from its own checkpoints (same hash) unless ``checkpoint.load`` names another; the ranks
write both into every manifest (``launcher/core/checkpoint_dir.py`` publish) and name the run that holds a
checkpoint directory's lock by the hash (``launcher/rank/checkpoint.py`` DirLock). Torch-free, standard library
only: the tests and tools compute the same identity as the ranks.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

# Fields that do not change what a checkpoint holds or how training continues from it: where and how the job
# is launched, logged and checkpointed, and how long it runs.
_NOT_IDENTITY = {"name", "action", "output_dir", "force", "logging", "slurm", "checkpoint",
                 "train.train_steps", "train.train_tokens", "train.exit_after_minutes", "train.eval_interval",
                 "train.eval_iters", "train.nonfinite", "train.straggler_interval", "train.straggler_margin",
                 "train.spike_factor", "train.spike_window", "train.spike_lr_factor", "train.spike_lr_steps",
                 "data.cache_dir", "data.num_workers", "schedule.record_timeline", "train.deterministic", "profile",
                 "timeouts", "post"}
_CLUSTER_IDENTITY = ("gpus_per_node", "backend")


def run_identity(job) -> dict:
    """The config values that make two runs the same run (flattened 'section.field' -> value)."""
    flat = {}

    def walk(prefix, value):
        if prefix in _NOT_IDENTITY:
            return
        if isinstance(value, dict) and prefix != "cluster.env":
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else key, sub)
        else:
            flat[prefix] = value

    raw = asdict(job)
    raw["cluster"] = {k: raw["cluster"][k] for k in _CLUSTER_IDENTITY}
    walk("", raw)
    return json.loads(json.dumps(flat, default=str))


def run_hash(identity: dict) -> str:
    """The run's name in its checkpoints' manifests and its directory lock (16 hex digits of the identity)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def identity_diff(theirs: dict, ours: dict, limit: int = 3) -> str:
    """The first ``limit`` fields two identities differ in, as ``field=theirs there, ours here`` (error lines)."""
    keys = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    shown = ", ".join(f"{k}={theirs.get(k)!r} there, {ours.get(k)!r} here" for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
