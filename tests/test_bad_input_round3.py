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
    from launcher.fields import hydra_quoted as _hydra_quoted
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


# ---- class 2: tracebacks ---------------------------------------------------------------------------------------

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ZB_V = ("recipe=smoke", "schedule.kind=zb_v", "parallel.virtual_pipeline=2")


def _one_error(code, err, field):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"error: {field}="), err


@pytest.fixture
def loop(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    return tmp_path / "a"


@pytest.mark.parametrize("field", ["output_dir", "checkpoint.dir", "data.cache_dir"])
@pytest.mark.parametrize("below", ["", "/sub"])
@pytest.mark.parametrize("action", ["validate", "render"])
def test_a_symlink_loop_is_one_line(field, below, action, loop, cli, tmp_path):
    out_dir = [] if field == "output_dir" else [f"output_dir={tmp_path / 'runs'}"]
    code, _, err = cli("recipe=smoke", *out_dir, f"{field}={loop}{below}", f"action={action}")
    _one_error(code, err, field)
    assert "symbolic-link loop" in err and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("costs", ["[inf,1,1]", "[1e308,1,1]", "[nan,1,1]", "[1,-inf,1]", "[1e300,1e-300,1]",
                                   "[1e-320,1,1]", "[1e7,1e7,1e7]"])
@pytest.mark.parametrize("action", ["validate", "plan", "render"])
def test_zb_v_costs_must_be_finite_and_in_range(costs, action, cli, tmp_path):
    code, _, err = cli(*ZB_V, f"schedule.zb_v_costs={costs}", f"output_dir={tmp_path}", f"action={action}")
    _one_error(code, err, "schedule.zb_v_costs")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("costs", ["[1000,1,1]", "[1e-6,1e-6,1e-6]", "[12.5,25.1,11.0]"])
def test_zb_v_costs_in_range_plan(costs, cli, tmp_path):
    code, _, err = cli(*ZB_V, f"schedule.zb_v_costs={costs}", f"output_dir={tmp_path}", "action=plan")
    assert code == 0, err


def test_help_into_a_closed_pipe_is_quiet():
    done = subprocess.run(f"{sys.executable} -m launcher --help | head -1", shell=True, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("usage:") and done.stderr == "", done.stderr


def _preprocess(*args):
    return subprocess.run([sys.executable, "-m", "data.preprocess", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("kind", ["text", "binary", "config", "empty", "directory", "loop"])
def test_preprocessor_refuses_a_tokenizer_that_is_not_tokenizers_json(kind, tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "hello"}\n')
    bad = tmp_path / "t" / ("tokenizer.model" if kind == "binary" else "config.json" if kind == "config" else "x")
    bad.parent.mkdir()
    if kind == "text":
        bad.write_text("not json at all\n")
    elif kind == "binary":
        bad.write_bytes(bytes(range(256)) * 8)
    elif kind == "config":
        bad.write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256}')
    elif kind == "empty":
        bad.write_text("")
    elif kind == "directory":
        bad = bad.parent
    else:
        (tmp_path / "t" / "l").symlink_to(bad)
        bad.symlink_to(tmp_path / "t" / "l")
    done = _preprocess("--input", str(tmp_path / "c.jsonl"), "--tokenizer", str(bad), "--output-prefix",
                       str(tmp_path / "out"))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: --tokenizer {bad}: "), done.stderr
    assert not list(tmp_path.glob("out*"))


def test_preprocessor_points_to_the_tokenizer_beside_a_config(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "config.json").write_text('{"architectures": ["X"], "vocab_size": 5}')
    (tmp_path / "tokenizer.json").write_bytes((ROOT / "data/assets/tokenizer.json").read_bytes())
    done = _preprocess("--input", str(tmp_path / "c.jsonl"), "--tokenizer", str(tmp_path / "config.json"),
                       "--output-prefix", str(tmp_path / "out"))
    assert done.returncode == 2 and done.stderr.strip().endswith(f"try --tokenizer {tmp_path / 'tokenizer.json'}")


# ---- class 3: accepted on the login node, failing on the ranks --------------------------------------------------

@pytest.mark.parametrize("kind", ["text", "binary", "config", "directory"])
def test_validate_checks_the_tokenizer_is_tokenizers_json(kind, cli, tmp_path):
    good = (ROOT / "data/assets/tokenizer.json").read_bytes()
    if kind == "text":
        (tmp_path / "t.json").write_text("garbage\n")
        bad, hint = tmp_path / "t.json", None
    elif kind == "binary":
        (tmp_path / "tokenizer.model").write_bytes(bytes(range(256)) * 8)
        bad, hint = tmp_path / "tokenizer.model", None
    elif kind == "config":
        (tmp_path / "config.json").write_text('{"architectures": ["X"], "model_type": "llama"}')
        (tmp_path / "tokenizer.json").write_bytes(good)
        bad, hint = tmp_path / "config.json", tmp_path / "tokenizer.json"
    else:
        (tmp_path / "tokenizer.json").write_bytes(good)
        bad, hint = tmp_path, tmp_path / "tokenizer.json"
    code, _, err = cli("recipe=smoke", f"data.tokenizer={bad}", "action=validate")
    _one_error(code, err, "data.tokenizer")
    if hint is not None:
        assert err.strip().endswith(f"try data.tokenizer={hint}"), err
        code, _, err = cli("recipe=smoke", f"data.tokenizer={hint}", "action=validate")
        assert code == 0, err  # the alternative printed validates


def test_checkpoint_load_that_is_a_file_is_refused_before_rendering(cli, tmp_path):
    (tmp_path / "ckpt").write_text("not a checkpoint\n")
    for action in ("validate", "render"):
        code, _, err = cli("recipe=smoke", f"checkpoint.load={tmp_path / 'ckpt'}", f"action={action}",
                           f"output_dir={tmp_path / 'out'}")
        _one_error(code, err, "checkpoint.load")
        assert "is a file; a checkpoint is a directory" in err and err.strip().endswith(
            "try checkpoint.load=null (start from step 0)"), err
    assert not (tmp_path / "out").exists()


# ---- class 5: meaning silently changed ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["1f1b", "zb_h1"])
def test_zb_v_costs_on_another_schedule_are_said_to_be_ignored(kind, cli):
    code, out, err = cli("recipe=smoke", f"schedule.kind={kind}", "schedule.zb_v_costs=[1,2,1]", "action=validate")
    assert code == 0
    assert (f"warning: schedule.zb_v_costs=[1.0, 2.0, 1.0]: orders schedule.kind=zb_v only; {kind} ignores it; "
            "try schedule.zb_v_costs=null") in err + out


@pytest.mark.parametrize("override,field", [("train.lr=1e308", "train.lr"), ("train.lr=1", "train.lr"),
                                            ("train.min_lr=2", "train.min_lr"),
                                            ("cluster.peak_tflops_bf16=1e308", "cluster.peak_tflops_bf16"),
                                            ("cluster.peak_tflops_fp8=inf", "cluster.peak_tflops_fp8")])
def test_absurd_rates_and_peaks_are_refused(override, field, cli):
    """Accepted before (a learning rate of 1e308 trains nothing; a peak of 1e308 plans every step in 0 s)."""
    code, _, err = cli("recipe=smoke", override, "action=validate")
    _one_error(code, err, field)
