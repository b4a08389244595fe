"""Bad input, round five: values the user types as Megatron writes them, or leaves empty, get the field's one line
with a hint that composes.

- a config group left empty or null (``recipe=``, ``cluster=null``): Hydra's "Could not find 'recipe/'" / "Config
  group override must be a string" (with its search path) became the group's line;
- a list field given a bare value (``train.cuda_graph_modules=attn``; Megatron's ``--recompute-modules core_attn
  mlp`` and ``cuda_graph_scope=attn``): the hint is the same items as our list, ``[core_attn,mlp]``, not a
  bare value that the field refuses in turn;
- a key without a value (``train.lr``), Hydra's delete (``~train.lr``), a new key of a free-form dict without '+'
  (``cluster.env.FOO=bar``): the field's line set to a value, instead of an unrelated example or Hydra's text.
"""
from __future__ import annotations

import pytest

from launcher.overrides import GROUPS


def _line(code, err, start):
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1, err
    assert errors[0].startswith(start), err
    return errors[0]


def _first_hint(line: str) -> list[str]:
    return line.rsplit("; try ", 1)[1].split(" or ")[0].split()


@pytest.mark.parametrize("value", ["", "null"])
@pytest.mark.parametrize("group", GROUPS)
def test_an_empty_or_null_group_is_its_line_with_an_option_that_composes(group, value, cli):
    from launcher.config import compose_job

    code, _, err = cli(f"{group}={value}", "action=validate")
    a = "an" if group[0] in "aeiou" else "a"
    line = _line(code, err, f"error: {group}={value!r}: names no {group}; {a} {group} is one of recipes/{group}/ (")
    assert "search path" not in line and "NoneType" not in line
    hint = _first_hint(line)
    assert len(hint) == 1 and hint[0].lstrip("+").startswith(f"{group}=") and hint[0] != f"{group}={value}"
    compose_job([*hint])  # an option that exists, typed as Hydra takes it


def test_the_recipe_and_cluster_hints_for_an_empty_group_are_the_defaults_and_validate(cli):
    for group, default in (("recipe", "smoke"), ("cluster", "local")):
        code, _, err = cli(f"{group}=", "action=validate")
        hint = _first_hint(_line(code, err, f"error: {group}=''"))
        assert hint == [f"{group}={default}"], err
        assert cli(*hint, "action=validate")[0] == 0


@pytest.mark.parametrize("typed,rule,want", [
    ("experiment=bf16", "no defaults list chooses an experiment", "+experiment=bf16"),
    ("+experiment=bf1", "no such experiment", "+experiment=bf16"),
    ("++experiment=tiny", "'++' (force add) is for values", "+experiment=tiny"),
    ("+recipe=llama3_8b", "the defaults list already chooses a recipe", "recipe=llama3_8b"),
    ("++cluster=h200", "'++' (force add) is for values", "cluster=h200"),
])
def test_a_group_is_added_or_overridden_as_its_defaults_list_has_it(typed, rule, want, cli):
    """Hydra's "Could not override 'experiment'. No match in the defaults list", "Multiple values for recipe" and
    "force-add of config groups is not supported" as the group's line, with the spelling Hydra takes."""
    group = typed.lstrip("+").split("=")[0]
    code, _, err = cli(typed, "action=validate")
    line = _line(code, err, f"error: {group}=")
    assert rule in line and _first_hint(line) == [want], line
    assert cli(want, "action=validate")[0] == 0


@pytest.mark.parametrize("args,want", [
    (["train.cuda_graph_modules=attn"], "train.cuda_graph_modules=[attn]"),
    (["train.cuda_graph_modules='attn moe_router'"], "train.cuda_graph_modules=[attn,moe_router]"),  # quoted
    (["train.recompute=selective", "train.recompute_modules=core_attn"], "train.recompute_modules=[core_attn]"),
    (["profile.ranks=0"], "profile.ranks=[0]"),
])
def test_a_bare_value_for_a_list_field_is_hinted_as_that_list(args, want, cli):
    code, _, err = cli("recipe=qwen3_30b_a3b", *args, "action=validate")
    field = want.split("=", 1)[0]
    hint = _first_hint(_line(code, err, f"error: {field}="))
    assert hint == [want], err
    code, _, err = cli("recipe=qwen3_30b_a3b", *[a for a in args if not a.startswith(field)], *hint, "action=validate")
    assert f"error: {field}=" not in err, err  # the field takes it (other rules may still speak)


@pytest.mark.parametrize("argv,want", [
    (["cuda_graph_scope=attn"], "train.cuda_graph_modules=[attn]"),
    (["cuda_graph_scope=[attn,moe_router]"], "train.cuda_graph_modules=[attn,moe_router]"),
    (["--cuda-graph-scope", "attn", "moe_router"], "train.cuda_graph_modules=[attn,moe_router]"),
    (["recompute_modules=core_attn"], "train.recompute_modules=[core_attn]"),
    (["--recompute-modules", "core_attn", "mlp", "recipe=smoke"], "train.recompute_modules=[core_attn,mlp]"),
    (["--data-path", "a", "b"], "'data.blend=[a,b]'"),
    (["--tensor-model-parallel-size", "4", "recipe=smoke"], "parallel.tensor=4"),
    (["--save", "/ck", "stray"], "checkpoint.dir=/ck"),  # a one-value flag takes its first word only
    (["--wandb-project", "my proj"], "'logging.wandb_project=\"my proj\"'"),  # one word with a space: quoted
    (["--split", "949,50,1"], "'data.split=\"949,50,1\"'"),  # unquoted, Hydra reads a sweep
])
def test_megatrons_names_with_list_values_get_our_list(argv, want, cli):
    import shlex

    from launcher.config import compose_job

    code, _, err = cli(*argv, "action=validate")
    line = _line(code, err, "error: ")
    assert line.endswith(f"; try {want}") or f"; try {want} " in line or line.endswith(f" {want}"), line
    compose_job([o for o in shlex.split(want) if "=" in o])  # the override composes: the field's type takes it


@pytest.mark.parametrize("typed,field,rule,want", [
    ("~train.lr", "train.lr", "Hydra's '~' deletes a key", "train.lr=0.0003"),
    ("~train.lr=3e-4", "train.lr", "Hydra's '~' deletes a key", "train.lr=0.0003"),
    ("train.lr", "train.lr", "overrides are key=value", "train.lr=0.0003"),
    ("nodes", "nodes", "overrides are key=value", "nodes=1"),
    ("~recipe", "recipe", "Hydra's '~' deletes a key", "recipe=smoke"),
    ("~experiment", "experiment", "Hydra's '~' deletes a key", "+experiment=bf16"),
    ("train.lrr", "train.lrr", "no such field", "train.lr=0.0003"),
    ("~train.lrr", "train.lrr", "no such field", "train.lr=0.0003"),
    ("cluster.env.FOO=bar", "cluster.env.FOO", "a new key is added with '+'", "+cluster.env.FOO=bar"),
    ("cluster.env=null", "cluster.env", "must be a mapping", "cluster.env={}"),
])
def test_a_key_without_a_value_or_deleted_is_its_fields_line_set_to_a_value(typed, field, rule, want, cli):
    """``train.lr`` (no value), Hydra's delete (``~train.lr``: "Could not delete from config. The value of 'train.lr'
    is 0.003 and not 0.0003") and a new key of a free-form dict without '+' ("Could not override 'cluster.env.FOO'.
    To append to your config use +cluster.env.FOO=bar"): the field's line, and a hint that validates."""
    code, _, err = cli(typed, "action=validate")
    line = _line(code, err, f"error: {field}=")
    assert rule in line and _first_hint(line) == [want], line
    assert cli(want, "action=validate")[0] == 0


@pytest.mark.parametrize("typed,want", [
    ("cluster.env.FOO=a b", "+cluster.env.FOO=a b"),  # the value as typed (Hydra's message cuts it at the space)
    ("cluster.env.FOO=[1,2]", '+cluster.env.FOO="[1,2]"'),  # Dict[str, str]: as text, the list would not compose
])
def test_a_new_dict_key_is_offered_with_its_value_as_the_dict_takes_it(typed, want, cli):
    import shlex

    code, _, err = cli(typed, "action=validate")
    line = _line(code, err, f"error: {typed.split('=')[0]}={typed.split('=', 1)[1]!r}")
    hint = shlex.split(line.rsplit("; try ", 1)[1])
    assert hint == [want], line
    assert cli(*hint, "action=validate")[0] == 0
