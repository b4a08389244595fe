"""A run bundle's ``config.yaml``: the resolved job, written on the login node and read back on every rank.

OmegaConf is imported when called, not at import: the rest of the core (the layout, FLOPs) is pure Python and
must import where OmegaConf is absent (the bare GPU image the benchmark runs on).
"""
from __future__ import annotations

from pathlib import Path

from launcher.schema import JobConfig


def load_job(path: str | Path) -> JobConfig:
    """Load a resolved config.yaml back into a typed JobConfig (struct-checked against the schema)."""
    from omegaconf import OmegaConf

    base = OmegaConf.structured(JobConfig)
    return OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.load(str(path))))  # type: ignore[return-value]


def job_to_yaml(job: JobConfig) -> str:
    """Serialise a typed job to YAML (the bundle's resolved config)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(job))
