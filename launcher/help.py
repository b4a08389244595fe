"""`--help`: every config field with its type, default and docstring, read from launcher/schema.py itself."""
from __future__ import annotations

import ast
import dataclasses
import inspect
from functools import lru_cache

from launcher import schema

USAGE = """usage: python -m launcher [recipe=NAME] [cluster=NAME] [nodes=N] [action=ACTION] [key=value ...]
                          [--cfg job] [--json] [--help]

Compose a recipe, validate it, plan it, and render a run bundle (action=render, the default); action=submit
also submits it with sbatch; action=run (the default for cluster=local) runs it here with torchrun;
action=plan / search / validate only print; action=bench runs a few steps of the job's layout here and writes a
calibrated cluster profile (cluster.profile=PATH then uses it); action=megatron-args prints the equivalent Megatron-LM
pretrain_gpt.py arguments, and `python -m launcher import SCRIPT` turns a Megatron-LM launch script into a
recipe; `python -m launcher export-hf --checkpoint DIR/iter_N --output OUT` writes a checkpoint as a Hugging Face
model and `python -m launcher import-hf --hf DIR --output CKPT [key=value ...]` the reverse (--help on each).
After a launch, `python -m launcher runs [DIR]`, `status RUN`, `logs RUN [--rank N] [--follow]` and `cancel RUN`
(a stop checkpoint first) follow its run bundle; `python -m launcher post RUN` runs its post.* steps (export-hf,
eval.json per kept checkpoint), which action=run and a Slurm job's DONE start by themselves.
`python -m launcher checkpoint-info DIR [--json]` says what a checkpoint is (model, layout, formats, step, data position); with checkpoint.load or checkpoint.dir set,
action=validate and action=plan print whether this job loads it (as is, resharded, converted) or refuse it.
Any field below can be overridden with Hydra syntax (parallel.tensor=4, 'data.blend=[0.3,a,0.7,b]',
+experiment=bf16).
"""


@lru_cache(maxsize=None)
def field_docs() -> dict[str, dict[str, str]]:
    """{ClassName: {field: docstring}} from the string literal placed under each dataclass field."""
    tree = ast.parse(inspect.getsource(schema))
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        entries, body = {}, node.body
        for stmt, nxt in zip(body, body[1:] + [None]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                entries[stmt.target.id] = " ".join(nxt.value.value.split())
        docs[node.name] = entries
    return docs


def _options(group: str) -> str:
    from launcher.overrides import group_options

    return ", ".join(group_options(group))


def _allowed(f: dataclasses.Field) -> str:
    """" [one of: a, b, c]" for a choice field (the schema's single list of allowed values)."""
    allowed = f.metadata.get("choices")
    if not allowed:
        return ""
    return f" [one of: {', '.join(map(str, allowed))}{', null' if f.metadata.get('nullable') else ''}]"


def help_text() -> str:
    docs = field_docs()
    lines = [USAGE, f"recipes:  {_options('recipe')}", f"clusters: {_options('cluster')}",
             f"models:   {_options('model')}", f"data:     {_options('data')}",
             f"experiments (+experiment=): {_options('experiment')}", ""]
    root = schema.JobConfig
    for f in dataclasses.fields(root):
        if f.name in schema.SECTIONS:
            continue
        lines.append(f"  {f.name:<38} {docs[root.__name__].get(f.name, '')}{_allowed(f)}")
    for section, cls in schema.SECTIONS.items():
        lines.append(f"\n{section}: {cls.__doc__}")
        for f in dataclasses.fields(cls):
            lines.append(f"  {section + '.' + f.name:<38} {docs[cls.__name__].get(f.name, '')}{_allowed(f)}")
    return "\n".join(lines) + "\n"


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return ""
    return "null" if value is None else str(value)


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def fields_markdown() -> str:
    """docs/fields.md: every field, its default and its documentation, generated from launcher/schema.py
    (`python -m launcher.help --fields-md > docs/fields.md`; tests/test_docs.py checks the file is current)."""
    docs = field_docs()
    root = schema.JobConfig
    lines = ["# Every field", "",
             "Generated from `launcher/schema.py` by `python -m launcher.help --fields-md > docs/fields.md`; "
             "do not edit by hand (`tests/test_docs.py` checks it is current). Set any field on the command line "
             "with Hydra syntax (`parallel.tensor=4`); `python -m launcher --help` prints the same.", "",
             f"Recipes: {_options('recipe')}. Clusters: {_options('cluster')}. Models: {_options('model')}. "
             f"Data: {_options('data')}. Experiments (`+experiment=`): {_options('experiment')}.", ""]
    top = [f for f in dataclasses.fields(root) if f.name not in schema.SECTIONS]
    sections = [("top level", root, top, "")] + [(s, c, list(dataclasses.fields(c)), s + ".")
                                                 for s, c in schema.SECTIONS.items()]
    for title, cls, fields, prefix in sections:
        lines += [f"## {title}", ""]
        if cls is not root and cls.__doc__:
            lines += [" ".join(cls.__doc__.split()), ""]
        lines += ["| field | default | documentation |", "| --- | --- | --- |"]
        for f in fields:
            doc = docs[cls.__name__].get(f.name, "") + _allowed(f)
            lines.append(f"| `{prefix}{f.name}` | `{_md(_default(f))}` | {_md(doc.strip())} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m launcher.help --fields-md
    import sys

    if sys.argv[1:] != ["--fields-md"]:
        sys.exit("usage: python -m launcher.help --fields-md")
    sys.stdout.write(fields_markdown())
