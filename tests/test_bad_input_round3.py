"""Issue 45, "bad input, round three": each class of mistake as a general rule, one line, exit 2, no traceback.

Class 1, secrets: no interpolation form that OmegaConf accepts can read the environment into the bundle, and no
override can carry a secret variable's value there (the shell expanded it)."""
from __future__ import annotations

import pytest

SECRET = "s3cr3t-value-4711"
SMOKE = ("recipe=smoke", "cluster=local")

# Every spelling OmegaConf's grammar accepts for reading the environment: quoted and unquoted names, spaces,
# defaults, a name computed by another interpolation (whole or in part), nested resolvers, and oc.decode /
# oc.create evaluating an escaped interpolation at resolution time (no `oc.env` visible to a text scan).
FORMS = [
    "${oc.env:WANDB_API_KEY}",
    "${oc.env:'WANDB_API_KEY'}",
    '${oc.env:"WANDB_API_KEY"}',
    "${oc.env: WANDB_API_KEY }",
    "${ oc.env :WANDB_API_KEY}",
    "${oc.env:WANDB_API_KEY,fallback}",
    "${oc.env:'WANDB_API_KEY','fallback'}",
    "${oc.env:NOT_SET_ANYWHERE_45,${oc.env:WANDB_API_KEY}}",
    "${oc.env:${cluster.env.N}}",
    "${oc.env:'${cluster.env.N}'}",
    "${oc.env:WANDB_${cluster.env.S}}",
    "${oc.env:'WANDB_${cluster.env.S}'}",
    "${oc.decode:${oc.env:WANDB_API_KEY}}",
    "${oc.decode:'\\${oc.env:WANDB_API_KEY}'}",
    "prefix-${oc.env:WANDB_API_KEY}-suffix",
    "${oc.env:MY_PLAIN_VAR_45}",  # any variable: which ones hold secrets is not the launcher's to guess
    "${oc.env:'MY_PLAIN_VAR_45'}",
]


@pytest.fixture
def environment(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("MY_PLAIN_VAR_45", SECRET)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("field", ["+cluster.env.X", "logging.wandb_entity"])
@pytest.mark.parametrize("quoted", [False, True], ids=["as-typed", "hydra-quoted"])
def test_no_interpolation_reads_the_environment(form, field, quoted, cli, environment, tmp_path):
    from launcher.config import _hydra_quoted
    extra = ["+cluster.env.N=WANDB_API_KEY", "+cluster.env.S=API_KEY"] if "cluster.env." in form else []
    value = _hydra_quoted(form) if quoted else form
    code, out, err = cli(*SMOKE, *extra, f"{field}={value}", f"output_dir={tmp_path}", "action=render")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (form, out, err)
    assert SECRET not in out + err
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error: " + field.lstrip("+")), err
    assert "environment" in lines[0] or "secret variable" in lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("form", FORMS[:3])
def test_cfg_job_does_not_print_it_either(form, cli, environment):
    code, out, err = cli(*SMOKE, f"+cluster.env.X={form}", "--cfg", "job")
    assert code == 2 and SECRET not in out + err


def test_a_secret_expanded_by_the_shell_is_refused(cli, environment, tmp_path):
    # `logging.wandb_entity=$WANDB_API_KEY`: the shell hands the launcher the value itself
    code, out, err = cli(*SMOKE, f"logging.wandb_entity=run-{SECRET}", f"output_dir={tmp_path}", "action=render")
    assert code == 2 and err.count(SECRET) == 0 and "logging.wandb_entity" in err and "WANDB_API_KEY" in err, err
    assert list(tmp_path.iterdir()) == []


def test_every_resolver_the_login_node_registers_is_known():
    """A resolver added later must be reviewed here: may it read the environment (or a file)?"""
    from omegaconf.basecontainer import BaseContainer

    from launcher.config import ENVIRONMENT_FREE_RESOLVERS, _register
    _register()
    assert set(BaseContainer._resolvers) - {"oc.env"} <= ENVIRONMENT_FREE_RESOLVERS


def test_literal_text_is_not_an_interpolation(cli, environment):
    code, _, err = cli(*SMOKE, "+cluster.env.X='\\${oc.env:WANDB_API_KEY}'", "action=validate")
    assert code == 0, err
