"""A run bundle's ``config.yaml``: the resolved job, written on the login node and read back on every rank."""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from launcher.schema import JobConfig


def load_job(path: str | Path) -> JobConfig:
    """Load a resolved config.yaml back into a typed JobConfig (struct-checked against the schema)."""
    base = OmegaConf.structured(JobConfig)
    return OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.load(str(path))))  # type: ignore[return-value]


def job_to_yaml(job: JobConfig) -> str:
    """Serialise a typed job to YAML (the bundle's resolved config)."""
    return OmegaConf.to_yaml(OmegaConf.structured(job))
