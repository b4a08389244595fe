"""Compose a JobConfig from recipes + CLI overrides (Hydra compose API), and load one back from a bundle."""
from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from launcher import RECIPES_DIR, ROOT
from launcher.problems import Problem
from launcher.core.jobfile import job_to_yaml, load_job  # noqa: F401  (re-exported for login-side callers)
from launcher.schema import JobConfig, register


class ConfigError(Exception):
    """A recipe or override that cannot be composed (unknown key, wrong type, missing recipe). ``problem`` is
    the one-line form when the error names a schema field (a value Hydra cannot convert to the field's type)."""

    def __init__(self, message: str, problem: Optional[Problem] = None):
        super().__init__(message)
        self.problem = problem


def compose_dict(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose recipes/config.yaml with the overrides; struct mode rejects unknown keys."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    _register()
    try:
        with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base=None):
            return compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(_one_line(exc), _type_problem(exc, list(overrides))
                          or _grammar_problem(exc, list(overrides))) from None


GRAMMAR_RULE = ("Hydra's override grammar reads this value only inside quotes (it holds a character an unquoted "
                "value may not: a space, ;()[]{}=,'\" or a non-ASCII letter)")
"""Hydra's basic override grammar (https://hydra.cc/docs/advanced/override_grammar/basic/): an unquoted value is a
primitive made of letters, digits and a few symbols; anything else must be a quoted string."""


def _hydra_quoted(value: str) -> str:
    """``value`` as a Hydra quoted string (double quotes unless it holds one; quotes inside escaped)."""
    if '"' not in value:
        return f'"{value}"'
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _grammar_problem(exc: Exception, overrides: list[str]) -> Optional[Problem]:
    """Hydra's "LexerNoViableAltException: name=a;b ^ See https://hydra.cc/..." (a value its grammar cannot read
    unquoted: shell metacharacters, a newline, non-ASCII letters) as our one line. The value is read again as the
    quoted string it was surely meant to be: if the field's own rules refuse it, that is the line (with its checked
    alternative); else the line names the grammar and offers the quoted override, shell-quoted, as typed."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    if not isinstance(exc, OverrideParseException):
        return None
    parser = OverridesParser.create()
    for i, text in enumerate(overrides):
        try:
            parser.parse_override(text)
            continue
        except Exception:  # noqa: BLE001 - hydra raises several types for a bad override
            pass
        key, sep, value = text.partition("=")
        if not sep:
            return None
        quoted = f"{key}={_hydra_quoted(value)}"
        problem = Problem(key.lstrip("+~"), value, GRAMMAR_RULE, shlex.quote(quoted))
        try:
            job = compose_job([*overrides[:i], quoted, *overrides[i + 1:]])
        except ConfigError as again:  # quoted, it is still not a value of the field (a number field, say)
            return dataclasses.replace(again.problem, value=value) if again.problem else problem
        from launcher.validate import raw_problems, verified_hint

        found = raw_problems(job)
        own = [p for p in found if p.field == problem.field and p.severity == "error"]
        return verified_hint(job, own[0], found) if own else problem
    return None


def _register() -> None:
    """The schema, and ``${checkout:REL}``: REL inside the launcher checkout, absolute (the shipped corpus and
    tokenizer in recipes/data/shipped.yaml), since a relative path means the directory the command runs in
    (launcher/core/paths.py)."""
    register()
    if not OmegaConf.has_resolver("checkout"):
        OmegaConf.register_new_resolver("checkout", lambda rel="": str(ROOT / rel))


def compose_jobs(many: Sequence[Sequence[str]]) -> list[JobConfig]:
    """Compose and type several jobs under one Hydra initialisation (the catalogue composes 17 recipes: about a
    quarter less CPU time than one initialisation each)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    _register()
    with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base=None):
        try:
            return [to_job(compose(config_name="config", overrides=list(o))) for o in many]
        except (HydraException, OmegaConfBaseException, ValueError) as exc:
            raise ConfigError(_one_line(exc)) from None


def _type_problem(exc: Exception, overrides: list[str]) -> Optional[Problem]:
    """Hydra's "Value 'two' of type 'str' could not be converted to Integer" as our one line: the field, the
    value typed, the field's type and range, and the value the job had without that override."""
    from omegaconf.errors import ValidationError

    cause = exc.__cause__ if isinstance(exc.__cause__, ValidationError) else exc
    key = getattr(cause, "full_key", None)
    if not isinstance(cause, ValidationError) or not key:
        return None
    from launcher.fields import FIELD_TYPES
    from launcher.validate import raw_problems, verified_hint
    from launcher.validate.generic import field_rule

    field = key if key in FIELD_TYPES else ".".join(str(key).split(".")[:2])
    if field not in FIELD_TYPES:
        return None
    typed = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in (key, field)]
    value = typed[-1].split("=", 1)[1] if typed else getattr(cause, "msg", str(cause))
    problem = Problem(field, value, f"must be {field_rule(field)}", f"{field}=<{field_rule(field)}>")
    try:  # the job without the offending override: its value for the field, verified like any hint
        job = compose_job([o for o in overrides if o not in typed])
    except ConfigError:
        return problem
    current = job
    for part in field.split("."):
        current = getattr(current, part)
    if isinstance(current, (dict, list)):
        return problem
    shown = "null" if current is None else str(current).lower() if isinstance(current, bool) else str(current)
    hinted = dataclasses.replace(problem, hint=f"{field}={shown}")
    return verified_hint(job, hinted, raw_problems(job))


SECRET_REF = re.compile(r"\boc\.env\s*:\s*(\$\{|[A-Za-z_][A-Za-z0-9_]*)")
"""The variable an ``${oc.env:NAME}`` interpolation reads (or ``${`` when its name is itself interpolated)."""


def secret_problems(cfg: DictConfig) -> list[Problem]:
    """Interpolations that would write a secret's value into the bundle: ``${oc.env:NAME}`` anywhere in the
    job, where NAME is in cluster.secret_env or looks like a secret (or is computed by another interpolation).
    Checked on the unresolved config, before anything reads the value."""
    from launcher.validate.run import SECRET_NAME

    tree = OmegaConf.to_container(cfg, resolve=False)
    secret_env = (tree.get("cluster") or {}).get("secret_env") or []
    listed = {str(n) for n in secret_env} if isinstance(secret_env, list) else set()
    problems = []
    for path, text in _strings(tree):
        for name in SECRET_REF.findall(text):
            if name == "${" or name in listed or SECRET_NAME.search(name):
                shown = "a computed variable name" if name == "${" else f"the secret variable {name}"
                problems.append(Problem(path, text, f"reads {shown} through an interpolation, so its value would be "
                                        "written into the run bundle (config.yaml, env.sh)",
                                        "listing it in cluster.secret_env (passed by name, never written) and exporting it in your shell"))
                break
    return problems


def _strings(node, path: str = ""):
    """(dotted path, text) of every string in a container tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _strings(value, f"{path}[{i}]")
    elif isinstance(node, str) and "${" in node:
        yield path, node


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
