"""Check CLI overrides against the schema before Hydra sees them, to answer typos with "did you mean"."""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Optional

from launcher import RECIPES_DIR
from launcher.problems import Problem
from launcher.schema import SECTIONS, JobConfig

GROUPS = ("recipe", "cluster", "model", "data", "experiment")
FREE_FORM = {("cluster", "env")}  # dict fields: any key is allowed below them


def _field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def check_override(text: str) -> Optional[Problem]:
    """A Problem for an override naming an unknown field or group option; None when it looks fine."""
    if "=" not in text:
        return Problem("override", text, "overrides are key=value", "parallel.tensor=2")
    key, value = text.split("=", 1)
    key = key.lstrip("+~")
    if key.startswith("hydra.") or key.startswith("hydra/"):
        return None
    parts = key.split(".")
    if key == "action" and value == "import":
        return Problem(key, value, "import is a sub-command, not an action",
                       "python -m launcher import SCRIPT_OR_ARGS_FILE")
    if len(parts) == 1 and parts[0] in GROUPS:
        return _check_group_option(parts[0], value)
    if len(parts) == 1:
        return _unknown(key, value, parts[0], _field_names(JobConfig) + list(GROUPS), "", "") \
            if parts[0] not in _field_names(JobConfig) else None
    section, name = parts[0], parts[1]
    if section not in SECTIONS:
        return _unknown(key, value, section, list(SECTIONS), "", key[len(section):])
    if (section, name) in FREE_FORM:
        return None
    if name not in _field_names(SECTIONS[section]):
        rest = key[len(section) + len(name) + 1:]  # deeper parts of the key, kept in the hint
        return _unknown(key, value, name, _field_names(SECTIONS[section]), section + ".", rest)
    return None


@dataclass(frozen=True)
class MegatronName(Problem):
    """An unknown key that is Megatron-LM's or Megatron-Core's name for one of our fields: the line is the
    answer itself ("tensor_model_parallel_size is Megatron's name for parallel.tensor; try parallel.tensor=4")."""

    def line(self) -> str:
        return f"error: {self.rule}"


def megatron_hint(key: str, value: Optional[str]) -> Optional[Problem]:
    """The Problem for a Megatron-LM argument / Megatron-Core config name used as a key; None if it is neither."""
    from launcher.megatron_lm.table import hint_for
    answer = hint_for(key, value)
    return MegatronName(key, value, answer, answer.rsplit("; try ", 1)[-1]) if answer else None


def _unknown(key: str, value: str, name: str, known: list[str], prefix: str, rest: str) -> Problem:
    """A typo: the closest known name, spelled out as the whole override with the value typed."""
    renamed = megatron_hint(name, value)
    if renamed is not None:
        return renamed
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"{prefix}{close[0]}{rest}={value}" if close else \
        f"one of {', '.join(prefix + k for k in known[:8])}, ..."
    return Problem(key, value, "no such field in the schema (launcher/schema.py; see --help)", hint)


def _check_group_option(group: str, value: str) -> Optional[Problem]:
    options = sorted(p.stem for p in (RECIPES_DIR / group).glob("*.yaml"))
    if value in options or value in ("null", ""):
        return None
    close = difflib.get_close_matches(value, options, n=1)
    return Problem(group, value, f"no such {group} in recipes/{group}/ ({', '.join(options)})",
                   f"{group}={close[0] if close else options[0]}")
