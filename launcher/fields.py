"""The schema read as data: every field's dotted name and type, its default spelt as an override, the fields
declared with ``choice(...)``, and the subset of Hydra's override grammar that hints use to set a value.

Read by validation (``launcher/validate/``), by the compose step's one-line type errors (``launcher/config.py``)
and by tests; the schema itself (``launcher/schema.py``) stays declarations only. Login-node code.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from launcher.schema import SECTIONS, JobConfig


def get_value(job: JobConfig, name: str):
    section, _, attr = name.rpartition(".")
    return getattr(getattr(job, section) if section else job, attr)


def choice_fields(job: JobConfig) -> Iterator[tuple[str, Any, dataclasses.Field]]:
    """(dotted name, section object, field) of every schema field declared with ``choice(...)``."""
    for prefix, section in (("", job), *((f"{name}.", getattr(job, name)) for name in SECTIONS)):
        for f in dataclasses.fields(section):
            if "choices" in f.metadata:
                yield prefix + f.name, section, f


def is_allowed(section, name: str) -> bool:
    """The value of ``section.name`` is one the schema allows (so rules that branch on it may read it)."""
    f = section.__dataclass_fields__[name]
    value = getattr(section, name)
    return value in f.metadata["choices"] or (value is None and f.metadata["nullable"])


def _schema_fields() -> dict[str, tuple[type, str]]:
    """dotted name -> (section class, annotation text) of every field (top-level ones as ``nodes``...)."""
    out = {}
    for f in dataclasses.fields(JobConfig):
        section = SECTIONS.get(f.name)
        if section is None:
            out[f.name] = (JobConfig, str(f.type))
        else:
            out.update({f"{f.name}.{g.name}": (section, str(g.type)) for g in dataclasses.fields(section)})
    return out


FIELD_TYPES = _schema_fields()


def parse_value(key: str, text: str):
    """``text`` as the value of field ``key`` (the subset of Hydra's override grammar that hints use)."""
    kind = FIELD_TYPES[key][1]
    text = text.strip("'\"")
    if text == "null":
        if not kind.startswith("Optional"):
            raise ValueError(f"{key} is not nullable")
        return None
    if "List" in kind:
        inner = text.strip("[]")
        items = [s.strip().strip("'\"") for s in inner.split(",") if s.strip()] if inner else []
        item = kind.split("List[", 1)[1]  # List[int] / List[float] items as numbers (profile.ranks=[0])
        return [int(x) for x in items] if item.startswith("int") else \
            [float(x) for x in items] if item.startswith("float") else items
    if "Dict" in kind:
        raise ValueError("dict fields are not set by hints")
    if "bool" in kind:
        if text.lower() not in ("true", "false"):
            raise ValueError(text)
        return text.lower() == "true"
    if "int" in kind:
        return int(text)
    if "float" in kind:
        return float(text)
    return text


def set_value(job: JobConfig, key: str, text: str) -> None:
    section, _, name = key.rpartition(".")
    setattr(getattr(job, section) if section else job, name, parse_value(key, text))


def default_text(key: str) -> str | None:
    """The schema default of a field, spelt as an override value (None: no simple default)."""
    section, _, name = key.rpartition(".")
    cls = SECTIONS[section] if section else JobConfig
    f = cls.__dataclass_fields__[name]
    if f.default is dataclasses.MISSING:
        return None
    value = f.default
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def is_list_field(key: str) -> bool:
    """Whether the schema types ``key`` as a list (its override is written [a,b])."""
    return "List" in FIELD_TYPES.get(key, (None, ""))[1]


def list_text(words: str) -> str:
    """Items typed bare, as Megatron-LM's nargs='+' takes them or comma-separated ("core_attn mlp", "a,b"), as the
    list an override of ours writes: [core_attn,mlp]."""
    return "[" + ",".join(words.replace(",", " ").split()) + "]"


def hydra_quoted(value: str) -> str:
    """``value`` as a Hydra quoted string (double quotes unless it holds one; quotes inside escaped)."""
    if '"' not in value:
        return f'"{value}"'
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
