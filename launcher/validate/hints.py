"""The hint search: a problem's printed alternative is kept only when the job with it applied no longer has
that problem and has no new error; when none does, the field's default or the nearest value that does is
searched (each try re-validates a copy of the job through ``raw_problems``). Login-node code.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import re

from launcher.fields import FIELD_TYPES, default_text, set_value
from launcher.problems import Problem, errors
from launcher.schema import JobConfig
from launcher.validate.sections import raw_problems


OVERRIDE = re.compile(r"([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)?)=(\S+)")
"""One ``section.field=value`` (or top-level ``field=value``) override in a hint."""


def problem_key(p: Problem) -> tuple[str, str]:
    """What identifies a problem across re-validation: its field and its rule without the numbers in it."""
    return p.field.split("[")[0], re.sub(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?", "#", p.rule)


def verified_hint(job: JobConfig, problem: Problem, problems: list[Problem]) -> Problem:
    """The problem with only those alternatives of its hint that fix it without a new error; alternatives
    that are not plain overrides (prose, group options such as cluster=h100) are kept as written. When every
    override alternative fails, the schema default of the field it set is tried; failing that, the hint
    names what to change without a number."""
    alternatives = [a.strip() for a in re.split(r"\s+or\s+", problem.hint) if a.strip()]
    parsed = [(a, hint_overrides(a)) for a in alternatives]
    if all(ov is None for _, ov in parsed):
        return problem
    before = {problem_key(p) for p in errors(problems)}
    kept = [a for a, ov in parsed if ov is None or _fixes(job, ov, problem, before)]
    tried = [ov for _, ov in parsed if ov]
    if not any(ov for a, ov in parsed if a in kept):
        for ov in tried:  # the schema's default for the same field(s)
            default = [(k, default_text(k)) for k, _ in ov]
            if all(t is not None for _, t in default) and default != ov and _fixes(job, default, problem, before):
                kept.insert(0, " ".join(f"{k}={t}" for k, t in default))
                break
    if not any(hint_overrides(a) for a in kept):
        names = list(dict.fromkeys([k for ov in tried for k, _ in ov]
                                   + ([problem.field] if problem.field in FIELD_TYPES else [])))
        kept = [a for a in kept if hint_overrides(a) is None]
        found = _searched_alternative(job, problem, before, names, tried)
        kept.insert(0, found or f"a different value of {' or '.join(sorted(names))}")
    return dataclasses.replace(problem, hint=" or ".join(dict.fromkeys(kept)))


SIZE_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)
"""Round sizes tried for an integer field when no stated alternative fixes its problem."""

SEARCHED_PER_FIELD = 24
"""At most this many values are tried per field (each try re-validates a copy: ~0.5 ms)."""


def _searched_alternative(job: JobConfig, problem: Problem, before: set, names: list[str],
                          stated: list) -> str | None:
    """When no stated alternative fixes the problem (it was, say, one of two errors a single override caused): the
    nearest value of one of the fields the rule names that fixes it without a new error, so the printed hint stays
    a checked override. Integers: multiples of the stated (or current) value and round sizes, nearest first;
    choices and booleans: the other options."""
    for name in names:
        for text in _candidate_values(job, name, [t for ov in stated for k, t in ov if k == name])[:SEARCHED_PER_FIELD]:
            if _fixes(job, [(name, text)], problem, before, own_fields_clean=True):
                return f"{name}={text}"
    return None


def _candidate_values(job: JobConfig, name: str, stated: list[str]) -> list[str]:
    cls, kind = FIELD_TYPES[name]
    section, _, attr = name.rpartition(".")
    current = getattr(getattr(job, section) if section else job, attr)
    f = cls.__dataclass_fields__[attr]
    null = ["null"] if kind.startswith("Optional") and current is not None else []
    if "choices" in f.metadata:
        return [str(c) for c in f.metadata["choices"] if c != current] + null
    if "bool" in kind:
        return ["false" if current else "true"] + null
    if "int" not in kind or "List" in kind or "Dict" in kind:
        return null
    ref = next((int(t) for t in stated if t.isascii() and t.isdigit() and int(t) > 0), None)
    ref = ref or (current if isinstance(current, int) and not isinstance(current, bool) and current > 0 else 1)
    ref = min(ref, SIZE_LADDER[-1])  # an absurd value (10**400) is not a reference: the ladder is
    values = (set(SIZE_LADDER) | {ref * k for k in range(1, 9)}) - {current}
    return [str(v) for v in sorted(values, key=lambda v: (abs(math.log(v) - math.log(ref)), v))] + ["0"] + null


def hint_overrides(text: str) -> list[tuple[str, str]] | None:
    """[(field, value)] when ``text`` is one or more schema-field overrides separated by spaces, else None."""
    tokens = text.split()
    pairs = [OVERRIDE.fullmatch(t) for t in tokens]
    if not tokens or not all(pairs) or not all(m[1] in FIELD_TYPES for m in pairs):
        return None
    return [(m[1], m[2]) for m in pairs]


def _fixes(job: JobConfig, overrides: list[tuple[str, str]], problem: Problem, before: set,
           own_fields_clean: bool = False) -> bool:
    """The overrides remove the problem without a new error (and, with ``own_fields_clean``, leave no error on the
    fields they set: an earlier error of the job, say a bound, can hide the rules a searched value would break,
    which run only once the bounds hold)."""
    fixed = copy.deepcopy(job)
    try:
        for key, text in overrides:
            set_value(fixed, key, text)
        after = raw_problems(fixed)
    except Exception:  # noqa: BLE001  -- a hint the job cannot even take is not printed
        return False
    keys = {problem_key(p) for p in after if p.severity == "error" or p.severity == problem.severity}
    new_errors = {problem_key(p) for p in errors(after)} - before
    touched = {k for k, _ in overrides} if own_fields_clean else set()
    return problem_key(problem) not in keys and not new_errors and not any(
        p.field.split("[")[0] in touched for p in errors(after))
