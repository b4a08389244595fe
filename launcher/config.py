"""Compose a JobConfig from recipes + CLI overrides (Hydra compose API), and load one back from a bundle."""
from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from launcher import RECIPES_DIR, ROOT
from launcher.problems import Problem, errors
from launcher.core.jobfile import job_to_yaml, load_job  # noqa: F401  (re-exported for login-side callers)
from launcher.fields import hydra_quoted, is_list_field, list_text
from launcher.schema import JobConfig, register


class ConfigError(Exception):
    """A recipe or override that cannot be composed (unknown key, wrong type, missing recipe). ``problem`` is
    the one-line form when the error names a schema field (a value Hydra cannot convert to the field's type)."""

    def __init__(self, message: str, problem: Optional[Problem] = None):
        super().__init__(message)
        self.problem = problem


def compose_dict(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose recipes/config.yaml with the overrides; struct mode rejects unknown keys."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    _register()
    try:
        return _compose(list(overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(_one_line(exc), _type_problem(exc, list(overrides))
                          or _grammar_problem(exc, list(overrides))
                          or _sweep_problem(exc, list(overrides))
                          or _append_problem(exc, list(overrides))) from None


BASES_KEPT = 32
"""Composed bases kept per process (each a few hundred kB): the planner's search and the validator's hint checks
compose the same recipe with different values many times over, a few recipes and clusters at a time."""
_BASES: "dict[tuple, DictConfig]" = {}
_GROUPS: dict = {}


def _compose(overrides: list[str]) -> DictConfig:
    """Hydra's compose, split where Hydra itself splits it (``ConfigLoaderImpl._load_configuration_impl``): the
    config-group overrides choose and merge the defaults list (~0.2 CPU s: ~16 YAML files parsed and merged into the
    schema), then the value overrides are applied to the merged config by Hydra's own
    ``_apply_overrides_to_config``, in struct mode. The merged config of each set of group overrides is kept
    (keyed also on every recipe file's mtime and size) and a deep copy of it gets the value overrides: the same
    result for ~15 ms. Overrides Hydra treats otherwise (a sweep, which it refuses in a single run, or one of
    Hydra's own ``hydra.*`` settings, such as a search path) take Hydra's whole path."""
    import copy
    import sys

    from hydra import compose
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import OmegaConfBaseException

    parsed = OverridesParser.create().parse_overrides(overrides=overrides)  # Hydra's first step, same errors
    if any(o.is_sweep_override() or re.split(r"[./@]", o.key_or_group)[0] == "hydra" for o in parsed):
        with _hydra():
            return compose(config_name="config", overrides=overrides)
    fingerprint = _recipes_fingerprint()
    # Hydra's rule (defaults_list.Overrides): a key naming a config group chooses from it, unless its value is a dict
    groups, values = [], []
    for o in parsed:
        chooses = not isinstance(o.value(), dict) and _group_exists(o.key_or_group, fingerprint)
        (groups if chooses else values).append(o)
    key = (fingerprint, tuple(o.input_line for o in groups))
    base = _BASES.get(key)
    if base is None:
        with _hydra():
            base = compose(config_name="config", overrides=[o.input_line for o in groups])
        while len(_BASES) >= BASES_KEPT:
            del _BASES[next(iter(_BASES))]
        _BASES[key] = base
    cfg = copy.deepcopy(base)
    try:
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    except OmegaConfBaseException as exc:  # as ConfigLoaderImpl.load_configuration wraps it
        raise ConfigCompositionException().with_traceback(sys.exc_info()[2]) from exc
    return cfg


def _hydra():
    """Hydra initialised on the recipes directory, unless it already is (``compose_jobs`` holds it open)."""
    import contextlib

    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return contextlib.nullcontext()
    return initialize_config_dir(config_dir=str(RECIPES_DIR), version_base=None)


def _recipes_fingerprint() -> tuple:
    """Every recipe file's path, mtime and size: a changed or added recipe composes afresh."""
    import os

    found = []
    for folder, _, files in os.walk(RECIPES_DIR):
        for name in files:
            stat = os.stat(os.path.join(folder, name))
            found.append((folder, name, stat.st_mtime_ns, stat.st_size))
    return (str(RECIPES_DIR), tuple(sorted(found)))


def _group_exists(name: str, fingerprint: tuple) -> bool:
    """Whether Hydra's repository (the recipes directory, the ConfigStore, Hydra's own configs) has this config
    group: asked of the repository Hydra builds for the recipe tree (kept with it: it only reads its sources),
    once per name."""
    key = (fingerprint, name)
    if key not in _GROUPS:
        if _REPOSITORY.get("fingerprint") != fingerprint:
            from hydra.core.global_hydra import GlobalHydra

            with _hydra():
                _REPOSITORY.update(fingerprint=fingerprint, repository=GlobalHydra.instance().config_loader().repository)
        _GROUPS[key] = _REPOSITORY["repository"].group_exists(name)
    return _GROUPS[key]


_REPOSITORY: dict = {}


def _append_problem(exc: Exception, overrides: list[str]) -> Optional[Problem]:
    """Hydra's "Could not override 'cluster.env.FOO'. To append to your config use +cluster.env.FOO=bar" (a new
    key of a free-form dict field) as the key's line, with the '+' Hydra asks for (a checked override: it composes)."""
    found = re.search(r"Could not override '([^']+)'\.\s+To append to your config use (\+\S+)", str(exc))
    if not found:
        return None
    import shlex

    key = found.group(1)
    typed = [o for o in overrides if o.split("=", 1)[0] == key]
    if not typed:
        return None
    value = typed[-1].split("=", 1)[1]  # as typed (Hydra's message cuts it at a space)
    rest = [o for o in overrides if o.split("=", 1)[0] != key]
    for hint in ("+" + typed[-1], f"+{key}={hydra_quoted(value)}"):  # as typed; else as text (Dict[str, str])
        try:
            compose_dict([*rest, hint])
            break
        except ConfigError:
            continue
    else:
        return None
    return Problem(key, value, f"{key.rsplit('.', 1)[0]} has no key {key.rsplit('.', 1)[1]!r} yet: a new key is "
                   "added with '+'", shlex.quote(hint))


SWEEP_RULES = {
    "number": "a comma is Hydra's list of values to sweep, not a decimal comma",
    "list": "a list is written in brackets (an unbracketed comma is Hydra's list of values to sweep)",
    "text": "an unquoted comma is Hydra's list of values to sweep; quote the value",
}
"""Hydra's "Ambiguous value for argument 'k=a,b'" (a sweep without --multirun), by the field's type."""


def _sweep_problem(exc: Exception, overrides: list[str]) -> Optional[Problem]:
    """Hydra's "Ambiguous value for argument 'train.lr=3,0e-4' 1. To use it as a list ... 3. To sweep over it, add
    --multirun" as our one line naming the field and its rule, with the alternative the field's type suggests, checked
    by composing it and validating the field: a decimal point for a number, brackets for a list, quotes for a text.
    This launcher submits one job per command; a sweep is a loop over commands."""
    import shlex

    from launcher.fields import FIELD_TYPES
    from launcher.validate.generic import field_rule

    message = str(exc)
    if not message.startswith("Ambiguous value for argument"):
        return None
    for i, text in enumerate(overrides):
        key, sep, value = text.partition("=")
        field = key.lstrip("+~")
        if not sep or text not in message or field not in FIELD_TYPES:
            continue
        kind = FIELD_TYPES[field][1]
        if "List" in kind:
            rule, alternative = SWEEP_RULES["list"], f"[{value}]"
        elif "float" in kind or "int" in kind:
            rule, alternative = SWEEP_RULES["number"], value.replace(",", ".", 1) if value.count(",") == 1 else None
        else:
            rule, alternative = SWEEP_RULES["text"], hydra_quoted(value)
        problem = Problem(field, value, f"must be {field_rule(field)}; {rule}", f"{field}=<{field_rule(field)}>")
        if alternative is None:
            return problem
        typed = f"{key}={alternative}"
        try:
            job = compose_job([*overrides[:i], typed, *overrides[i + 1:]])
        except ConfigError as again:  # read as meant, still not a value of the field: its own rule and hint
            return dataclasses.replace(again.problem, value=value, rule=f"{again.problem.rule}; {rule}") \
                if again.problem else problem
        from launcher.validate import raw_problems, verified_hint

        found = raw_problems(job)
        own = [p for p in found if p.field == field and p.severity == "error"]
        if own:
            return verified_hint(job, dataclasses.replace(own[0], value=value), found)
        return dataclasses.replace(problem, hint=shlex.quote(typed))
    return None


GRAMMAR_RULE = ("Hydra's override grammar reads this value only inside quotes (it holds a character an unquoted "
                "value may not: a space, ;()[]{}=,'\" or a non-ASCII letter)")
"""Hydra's basic override grammar (https://hydra.cc/docs/advanced/override_grammar/basic/): an unquoted value is a
primitive made of letters, digits and a few symbols; anything else must be a quoted string."""


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
        quoted = f"{key}={hydra_quoted(value)}"
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
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    _register()
    with _hydra():
        try:
            return [to_job(_compose(list(o))) for o in many]
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

    key = re.sub(r"(\[\d+\])+$", "", str(key))  # an item of a list field: schedule.zb_v_costs[0]
    field = key if key in FIELD_TYPES else ".".join(key.split(".")[:2])
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
    if isinstance(current, dict):  # a mapping is not one value to show: the empty one, where the job takes it
        try:
            emptied = compose_job([*(o for o in overrides if o not in typed), f"{field}={{}}"])
        except ConfigError:
            return problem
        return dataclasses.replace(problem, hint=f"{field}={{}}") if not errors(raw_problems(emptied)) else problem
    shown = ("null" if current is None else str(current).lower() if isinstance(current, bool) else
             "[" + ",".join(map(str, current)) + "]" if isinstance(current, list) else str(current))
    hint = f"{field}={shown}"
    bare = value.strip()
    if bare[:1] in ("'", '"') and bare[-1:] == bare[:1]:  # Hydra's quoted string: its text
        bare = bare[1:-1]
    if is_list_field(field) and bare.strip() and bare.strip()[0] not in "[{":
        # a bare value for a list field ("attn", or Megatron's space-separated "attn moe_router"): as a list first
        hint = f"{field}={list_text(bare)} or {hint}"
    hinted = dataclasses.replace(problem, hint=hint)
    return verified_hint(job, hinted, raw_problems(job))


ENVIRONMENT_FREE_RESOLVERS = frozenset({
    "oc.create", "oc.decode", "oc.deprecated", "oc.select", "oc.dict.keys", "oc.dict.values",  # OmegaConf's own
    "hydra", "now", "python_version",  # Hydra's: its own run config, the clock, the interpreter's version
    "checkout",  # ours: a path inside the launcher checkout
})
"""Every resolver the login node registers except ``oc.env``, each checked not to read the environment (a test
fails when one is added): so watching ``oc.env`` while the job resolves sees every environment read."""

ENVIRONMENT_RULE = ("reads the environment variable {name} through an interpolation, so its value would be written "
                    "into the run bundle (config.yaml, env.sh); no environment value is ever written there")


def secret_problems(cfg: DictConfig) -> list[Problem]:
    """Interpolations that read the environment, in any spelling OmegaConf accepts (quoted or unquoted names,
    defaults, computed or nested names, ``oc.decode``/``oc.create`` evaluating escaped text): the job is resolved
    once, node by node, with ``oc.env`` replaced by a recorder that returns a placeholder, so no value is read.
    Which variables hold secrets is not ours to guess (``DB_PASS``, ``MY_AUTH``): every read is refused."""
    from omegaconf import DictConfig, ListConfig
    from omegaconf.resolvers import oc

    read: list[str] = []

    def recorder(key, default=None):  # noqa: ARG001 - the default is never used: nothing is read
        read.append(str(key))
        return "environment-value-withheld"

    tree = OmegaConf.to_container(cfg, resolve=False)
    found: list[tuple[str, list[str]]] = []

    def walk(node, path: str) -> None:
        keys = list(node.keys()) if isinstance(node, DictConfig) else range(len(node))
        for key in keys:
            sub = f"{path}.{key}" if isinstance(node, DictConfig) else f"{path}[{key}]"
            sub = sub.lstrip(".")
            before = len(read)
            try:
                value = node[key]
            except Exception:  # noqa: BLE001 - a broken interpolation is reported when the job is typed
                value = None
            if len(read) > before:
                found.append((sub, read[before:]))
            elif isinstance(value, (DictConfig, ListConfig)):
                walk(value, sub)

    OmegaConf.register_new_resolver("oc.env", recorder, replace=True, use_cache=False)
    try:
        walk(cfg, "")
    finally:
        OmegaConf.register_new_resolver("oc.env", oc.env, replace=True, use_cache=False)
    return [_environment_problem(path, _typed(tree, path), names, tree) for path, names in found]


def _typed(tree, path: str) -> str:
    """The text the user wrote at ``path`` (unresolved), for the error line."""
    node = tree
    for part in re.findall(r"[^.\[\]]+", path):
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            return "${...}"
    return str(node)


def _environment_problem(path: str, text: str, names: list[str], tree) -> Problem:
    from launcher.validate.run import SECRET_NAME

    name = names[0]
    listed = (tree.get("cluster") or {}).get("secret_env") or []
    if SECRET_NAME.search(name) or name in [str(n) for n in listed] or not re.fullmatch(r"[A-Za-z_]\w*", name):
        hint = (f"cluster.secret_env=[{name}] with {path} dropped (export {name} in your shell: it is passed to the "
                "ranks by name, never written)") if re.fullmatch(r"[A-Za-z_]\w*", name) else \
            f"cluster.secret_env=[NAME] with {path} dropped (passed to the ranks by name, never written)"
    else:
        hint = f'{path}="${name}" (your shell expands it, and the value is in plain sight in the bundle)'
    return Problem(path, text, ENVIRONMENT_RULE.format(name=name if re.fullmatch(r"[A-Za-z_]\w*", name)
                                                        else "(a computed name)"), hint)


def secret_value_problems(job: JobConfig) -> list[Problem]:
    """A secret's value typed or expanded by the shell (``logging.wandb_entity=$WANDB_API_KEY``): any string of
    the job holding the value of a set environment variable that is listed in cluster.secret_env or named like a
    secret (values under 8 characters are too common to tell)."""
    import os

    from launcher.validate.run import SECRET_NAME

    listed = {str(n) for n in job.cluster.secret_env}
    secrets = {name: value for name, value in os.environ.items()
               if (name in listed or SECRET_NAME.search(name)) and len(value) >= 8}
    problems = []
    for path, text in _strings(dataclasses.asdict(job), every=True):
        for name, value in sorted(secrets.items()):
            if value in text:
                problems.append(Problem(path, "<redacted>", f"holds the value of the secret environment variable "
                                        f"{name} (expanded by your shell?); secrets are never written into a run "
                                        "bundle", f"cluster.secret_env=[{name}] (passed to the ranks by name) and "
                                        f"{path} without it"))
                break
    return problems


def _strings(node, path: str = "", every: bool = False):
    """(dotted path, text) of every interpolation (``every``: every string, keys of dicts included) in a tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            sub = f"{path}.{key}" if path else str(key)
            if every and isinstance(key, str):
                yield sub, key
            yield from _strings(value, sub, every)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _strings(value, f"{path}[{i}]", every)
    elif isinstance(node, str) and (every or "${" in node):
        yield path, node


def to_job(cfg: DictConfig) -> JobConfig:
    """Turn a composed DictConfig into typed dataclass instances."""
    from omegaconf.errors import OmegaConfBaseException

    leaks = secret_problems(cfg)  # every login-side job is typed here: none reads the environment
    if leaks:
        raise ConfigError(leaks[0].line().removeprefix("error: "), leaks[0])
    try:
        job = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(_one_line(exc)) from None
    if job.cluster.profile:  # a calibrated profile (action=bench): its fitted terms replace the cluster's
        from launcher.calibration import ProfileError, apply_profile
        try:
            job = apply_profile(job)
        except ProfileError as exc:
            raise ConfigError(str(exc).removeprefix("error: "), exc.problem) from None
    return job  # type: ignore[return-value]


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
