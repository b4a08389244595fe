"""launcher.config composes a job in two steps, where Hydra itself splits it: the config-group overrides choose and
merge the defaults list (kept per process, keyed on the recipe files), then Hydra's own `_apply_overrides_to_config`
applies the value overrides to a deep copy. Held here against Hydra's whole `compose` on the same overrides: the
same config (text and struct flag), or the same error (type, message and cause)."""
from __future__ import annotations

import random
import shutil

import pytest
from omegaconf import OmegaConf

from launcher import RECIPES_DIR
from launcher import config as config_module
from launcher.config import ConfigError, _compose, _register, compose_dict, compose_job
from test_fuzz_cli import _command, _fields

HOSTILE = [
    [],
    ["recipe=llama3_70b", "cluster=h200", "parallel.tensor=4", "train.lr=1e-4"],
    ["recipe=llama405b", "~train.lr"],  # a deletion of a value
    ["recipe=smoke", "~cluster"],  # a deletion of a group
    ["recipe=smoke", "+train.no_such_key=1"],  # an addition the schema refuses
    ["recipe=smoke", "train.no_such_key=1"],
    ["recipe=smoke", "++cluster.env.X=1"],
    ["recipe=smoke", "+cluster.env.X=1", "+cluster.env.X=2"],
    ["recipe=smoke", "model={num_layers: 3}"],  # a dict value for a group key: Hydra merges it as a value
    ["recipe=smoke", "recipe@foo=smoke"],  # a group chosen into another package
    ["recipe=nope"],
    ["recipe=smoke", "cluster=nope"],
    ["recipe=smoke", "train.lr=1,2"],  # a sweep: Hydra refuses it in a single run
    ["recipe=smoke", "train.lr=choice(1,2)"],
    ["recipe=smoke", "hydra.job.name=x"],
    ["recipe=smoke", "train.lr=abc"],  # a type error with a cause
    ["recipe=smoke", "train.train_steps=${model.num_layers}"],
    ["recipe=smoke", "parallel.tensor=2", "parallel.tensor=4"],  # the last one wins
    ["parallel.tensor=4", "recipe=llama3_8b"],  # a group chosen after a value
    ["recipe=smoke", "train.lr="],
    ["recipe=smoke", "a b"],
    ["+experiment=bf16", "recipe=llama3_8b", "~experiment"],
]


def _hydra_compose(overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def _outcome(fn, overrides):
    try:
        cfg = fn(list(overrides))
    except Exception as exc:  # noqa: BLE001 - the error itself is what is compared
        cause = exc.__cause__
        return ("error", type(exc).__name__, str(exc), type(cause).__name__, str(cause))
    return ("config", OmegaConf.to_yaml(cfg), OmegaConf.is_struct(cfg), OmegaConf.is_readonly(cfg))


def _corpus():
    rng, fields = random.Random(5), _fields()
    return HOSTILE + [_command(rng, fields) for _ in range(25)]


def test_the_kept_base_and_hydras_own_compose_agree():
    _register()
    for overrides in _corpus():
        assert _outcome(_compose, overrides) == _outcome(_hydra_compose, overrides), overrides


def test_a_changed_caller_copy_or_recipe_file_does_not_leak_into_the_next_compose(tmp_path, monkeypatch):
    first = compose_dict(["recipe=smoke", "train.lr=0.5"])
    first.train.train_steps = 12345  # the caller's own copy
    assert compose_dict(["recipe=smoke"]).train.train_steps != 12345
    recipes = tmp_path / "recipes"
    shutil.copytree(RECIPES_DIR, recipes)
    monkeypatch.setattr(config_module, "RECIPES_DIR", recipes)
    steps = compose_job(["recipe=smoke"]).train.train_steps
    smoke = recipes / "recipe" / "smoke.yaml"
    text = smoke.read_text()
    assert f"train_steps: {steps}" in text
    smoke.write_text(text.replace(f"train_steps: {steps}", f"train_steps: {steps + 7}"))
    assert compose_job(["recipe=smoke"]).train.train_steps == steps + 7
    (recipes / "recipe" / "extra.yaml").write_text(text.replace(f"train_steps: {steps}", f"train_steps: {steps + 11}"))
    assert compose_job(["recipe=extra"]).train.train_steps == steps + 11


def test_errors_keep_their_one_line():
    with pytest.raises(ConfigError) as caught:
        compose_dict(["recipe=smoke", "train.train_steps=two"])
    assert caught.value.problem is not None and caught.value.problem.field == "train.train_steps"
