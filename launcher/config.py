"""Compose a JobConfig from recipes + CLI overrides (Hydra compose API), and load one back from a bundle."""
from __future__ import annotations

from typing import Sequence

from omegaconf import DictConfig, OmegaConf

from launcher import RECIPES_DIR
from launcher.core.jobfile import job_to_yaml, load_job  # noqa: F401  (re-exported for login-side callers)
from launcher.schema import JobConfig, register


class ConfigError(Exception):
    """A recipe or override that cannot be composed (unknown key, wrong type, missing recipe)."""


def compose_dict(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose recipes/config.yaml with the overrides; struct mode rejects unknown keys."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register()
    try:
        with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base=None):
            return compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(_one_line(exc)) from None


def to_job(cfg: DictConfig) -> JobConfig:
    """Turn a composed DictConfig into typed dataclass instances."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError(_one_line(exc)) from None


def compose_job(overrides: Sequence[str] = ()) -> JobConfig:
    """Compose and type a job in one call."""
    return to_job(compose_dict(overrides))


def _one_line(exc: Exception) -> str:
    """Hydra/OmegaConf messages span lines with full keys/context; keep the informative first lines.

    Hydra wraps the OmegaConf error that names the type rule ("could not be converted to Integer") as the
    exception's cause, so that is appended.
    """
    cause = exc.__cause__
    text = str(exc).strip()
    if cause is not None:
        text += ": " + str(cause).strip().splitlines()[0]
    text = " ".join(text.split())
    text = text.replace("Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.", "")
    return text.strip()
