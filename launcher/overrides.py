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
    if "=" not in text or text.startswith("~"):
        return _not_a_setting(text)
    key, value = text.split("=", 1)
    key = key.lstrip("+~")
    if key.startswith("hydra.") or key.startswith("hydra/"):
        return None
    parts = key.split(".")
    if key == "action" and value == "import":
        return Problem(key, value, "import is a sub-command, not an action",
                       "python -m launcher import SCRIPT_OR_ARGS_FILE")
    if len(parts) == 1 and parts[0] in GROUPS:
        return _check_group_option(parts[0], value, text[:len(text) - len(text.lstrip("+"))])
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


def _not_a_setting(text: str) -> Problem:
    """``train.lr`` (no value) or Hydra's delete, ``~train.lr`` / ``~train.lr=3e-4`` (Hydra: "Could not delete from
    config. The value of 'train.lr' is 0.003 and not 0.0003"): the field's own line, with it set to its default."""
    from launcher.fields import FIELD_TYPES, default_text

    key = text.split("=", 1)[0].lstrip("~+")
    value = text.split("=", 1)[1] if "=" in text else ""
    rule = ("Hydra's '~' deletes a key, and every field of the typed schema keeps a value; set the one you want "
            "(without the override the recipe's value stays)") if text.startswith("~") else "overrides are key=value"
    if key in GROUPS:
        added = key not in _chosen_groups()
        return Problem(key, value, rule, f"{'+' if added else ''}{key}={_group_default(key) or group_options(key)[0]}")
    if key in FIELD_TYPES:
        return Problem(key, value, rule, f"{key}={default_text(key) or 'VALUE'}")
    unknown = check_override(f"{key}={value}") if key else None
    if unknown is not None and unknown.hint.endswith("=") and unknown.hint[:-1] in FIELD_TYPES:
        # the near name, set to its default (the typo's hint would repeat the empty value)
        unknown = dataclasses.replace(unknown, hint=unknown.hint + (default_text(unknown.hint[:-1]) or "VALUE"))
    return unknown or Problem("override", text, rule, "parallel.tensor=2")


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


def _check_group_option(group: str, value: str, plus: str = "") -> Optional[Problem]:
    """An option of a config group that exists, and typed as Hydra takes it: a group no defaults list chooses
    (experiment) is added with ``+``; one they choose is overridden without (``+recipe=`` adds a second recipe)."""
    options = group_options(group)
    added = group not in _chosen_groups()
    want = "+" if added else ""
    close = value if value in options else (difflib.get_close_matches(value, options, n=1) or [None])[0]
    hint = f"{want}{group}={close or _group_default(group) or options[0]}"
    a = "an" if group[0] in "aeiou" else "a"
    if value in ("", "null"):  # Hydra: "Could not find 'recipe/'" / "Config group override must be a string"
        return Problem(group, value, f"names no {group}; {a} {group} is one of recipes/{group}/ "
                       f"({', '.join(options)})", hint)
    if value not in options:
        return Problem(group, value, f"no such {group} in recipes/{group}/ ({', '.join(options)})", hint)
    if added and not plus:  # Hydra: "Could not override 'experiment'. No match in the defaults list."
        return Problem(group, value, f"no defaults list chooses {a} {group}: one is added on top of the recipe "
                       f"with '+'", hint)
    if plus == "++":  # Hydra: "force-add of config groups is not supported"
        return Problem(group, value, f"'++' (force add) is for values, not config groups", hint)
    if not added and plus == "+":  # Hydra: "Multiple values for recipe. To override a value use 'override ...'"
        return Problem(group, value, f"the defaults list already chooses {a} {group}: '+' would add a second; "
                       f"override it without '+'", hint)
    return None


def group_options(group: str) -> list[str]:
    """The options of a config group: the YAML files of recipes/<group>/."""
    return sorted(p.stem for p in (RECIPES_DIR / group).glob("*.yaml"))


def _defaults_list(path) -> dict[str, str]:
    """A recipe file's defaults list as {group: option} (``- cluster: local``, ``- /model: smoke``,
    ``- override /cluster: h100``; entries without a group, such as ``_self_``, left out)."""
    import yaml

    entries = (yaml.safe_load(path.read_text()) or {}).get("defaults") or []
    return {k.replace("override ", "").strip().lstrip("/").split("@")[0]: v
            for entry in entries if isinstance(entry, dict) for k, v in entry.items()}


def _chosen_groups() -> set[str]:
    """The config groups a defaults list chooses (recipes/config.yaml's and the recipes'); the others (experiment)
    are only ever added."""
    return {group for path in [RECIPES_DIR / "config.yaml", *sorted((RECIPES_DIR / "recipe").glob("*.yaml"))]
            for group in _defaults_list(path)}


def _group_default(group: str) -> Optional[str]:
    """The option recipes/config.yaml's defaults list chooses for ``group``, if any."""
    return _defaults_list(RECIPES_DIR / "config.yaml").get(group)
