"""Issue 45, round four: the classes left after round three, each as its general rule (one line naming the field,
its value, the rule and a checked alternative; exit 2 before anything is rendered; validate says what render says).

- validate = render: a predicted OOM and a step too long for the time limit are refused by validate too;
- Hydra's own messages (a sweep's comma, a list item of the wrong type) become the field's line;
- the wrong field blamed (a vocabulary no dataset can hold; a node count larger than the batch);
- a near-miss path gets the path it surely meant (a dataset prefix with .bin, a directory, Megatron's
  _text_document; the preprocessor's output prefix ending in a directory; an input named .gz that is not gzip);
- meaning silently changed (checkpoint.dir naming one checkpoint; evaluation with no validation split; a Megatron-LM
  script importing a path built from $PWD inside the importer's scratch directory).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "assets"
PREFIX = DATA / "smoke_text_document"


def _one_error(code, err, field):
    lines = [line for line in err.splitlines() if line.startswith(("error:", "warning:"))]
    errors = [line for line in lines if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1, err
    assert errors[0].startswith(f"error: {field}="), err
    return errors[0]


def _hint(line: str) -> list[str]:
    """The override(s) of the line's first alternative."""
    return line.rsplit("; try ", 1)[1].split(" or ")[0].split()


# ---- validate says what render says --------------------------------------------------------------------------

HUGE = ("model.hidden_size=65536", "model.ffn_hidden_size=131072")


@pytest.mark.parametrize("action", ["validate", "render"])
def test_predicted_oom_is_refused_by_validate_as_by_render(action, cli, tmp_path):
    code, out, err = cli("recipe=smoke", *HUGE, f"action={action}", f"output_dir={tmp_path}")
    line = _one_error(code, err, "force")
    assert err.startswith(line), err  # the one line first, the stages' details below it (fuzz test's rule)
    assert "stage 0 (" in err.split(line, 1)[1], err
    assert "predicted out of memory: pipeline stage 0 needs" in line and "force=true" in line, err
    assert list(tmp_path.iterdir()) == []
    code, out, err = cli("recipe=smoke", *HUGE, "force=true", "action=validate")
    assert code == 0 and out.startswith("valid:"), err


@pytest.mark.parametrize("recipe", [("recipe=smoke",), ("recipe=llama3_8b", "cluster=h100")])
@pytest.mark.parametrize("action", ["validate", "render"])
def test_a_step_longer_than_the_time_limit_names_the_batch(recipe, action, cli, tmp_path):
    """A global batch of 10^12 was valid to validate, then refused by render with 'slurm.time=265047-05:00:00'."""
    code, out, err = cli(*recipe, "train.global_batch_size=1000000000000", f"action={action}",
                         f"output_dir={tmp_path}")
    line = _one_error(code, err, "train.global_batch_size")
    assert "a step is planned at" in line and "slurm.time" in line, line
    assert list(tmp_path.iterdir()) == []
    hinted = _hint(line)
    assert hinted[0].startswith("train.global_batch_size=")
    code, out, err = cli(*recipe, *hinted, "action=validate")
    assert code == 0, err  # the alternative validates (and plans within the limit)


def test_a_long_but_possible_step_still_offers_the_time_limit(cli):
    """The batch hint replaces the time one only when no sensible limit would do: a step of about 20 minutes under a
    20-minute limit gets the limit it needs, and that limit validates."""
    job = ("recipe=llama3_8b", "cluster=h100", "train.global_batch_size=16384", "slurm.time=00:20:00")
    code, out, err = cli(*job, "action=validate")
    line = _one_error(code, err, "slurm.time")
    hinted = _hint(line)
    assert hinted[0].startswith("slurm.time="), line
    code, out, err = cli(*job, *hinted, "action=validate")
    assert code == 0, err


# ---- Hydra's own messages ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("override,field,hint", [
    ("train.lr=3,0e-4", "train.lr", "train.lr=3.0e-4"),
    ("data.split=100,0,0", "data.split", None),
    ("data.blend=a,b", "data.blend", "data.blend=[a,b]"),
    ("parallel.tensor=1,2", "parallel.tensor", None),
    ("schedule.zb_v_costs=[fast,slow,slow]", "schedule.zb_v_costs", "schedule.zb_v_costs=null"),
    ("profile.ranks=[a]", "profile.ranks", "profile.ranks=[0]"),
])
def test_hydra_sweeps_and_list_items_are_the_fields_line(override, field, hint, cli):
    code, out, err = cli("recipe=smoke", override, "action=validate")
    line = _one_error(code, err, field)
    assert "Ambiguous" not in line and "Error merging" not in line and "could not be converted" not in line, line
    if hint is not None:
        assert line.endswith(f"try {hint}") or line.endswith(f"try '{hint}'"), line
    assert "must be" in line or "run names" in line, line


def test_a_list_fields_rule_says_list(cli):
    code, out, err = cli("recipe=smoke", "schedule.zb_v_costs=[fast,slow,slow]", "action=validate")
    assert "must be a list of numbers" in err, err


def test_the_decimal_comma_alternative_validates(cli):
    code, out, err = cli("recipe=smoke", "train.lr=3,0e-4", "action=validate")
    line = _one_error(code, err, "train.lr")
    code, out, err = cli("recipe=smoke", *_hint(line), "action=validate")
    assert code == 0, err


# ---- the wrong field blamed ------------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", ["10000000000", "2147483649"])
def test_a_vocabulary_no_dataset_can_hold_is_the_vocabularys_line(vocab, cli):
    code, out, err = cli("recipe=smoke", f"model.vocab_size={vocab}", "action=validate")
    line = _one_error(code, err, "model.vocab_size")
    assert "dtype" not in line and "int32" in line, line


@pytest.mark.parametrize("recipe,nodes", [(("recipe=llama3_8b", "cluster=h100"), 100000),
                                          (("recipe=llama3_70b", "cluster=h100"), 100000),
                                          (("recipe=llama3_8b", "cluster=h100"), 48)])
def test_more_replicas_than_the_batch_names_the_nodes(recipe, nodes, cli):
    """The hint proposed a batch of 400,000 sequences for 100,000 nodes; it is the node count that is wrong."""
    code, out, err = cli(*recipe, f"nodes={nodes}", "action=validate")
    line = _one_error(code, err, "nodes")
    assert "more than the global batch holds micro batches" in line, line
    hinted = _hint(line)
    assert hinted[0].startswith("nodes=") and int(hinted[0].split("=")[1]) < nodes
    code, out, err = cli(*recipe, *hinted, "action=validate")
    assert code == 0, err


def test_a_batch_that_does_not_divide_still_names_the_batch(cli):
    code, out, err = cli("recipe=llama3_8b", "cluster=h100", "nodes=3", "action=validate")
    _one_error(code, err, "train.global_batch_size")


# ---- near-miss paths --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("given,why", [(f"{PREFIX}.bin", "drop .bin"), (f"{PREFIX}.idx", "drop .idx"),
                                       (str(DATA), "a directory is not a prefix"),
                                       (str(DATA / "smoke"), "_text_document")])
def test_a_prefix_that_surely_meant_another_gets_it(given, why, cli):
    code, out, err = cli("recipe=smoke", f"data.blend=[0.5,{given},0.5,{PREFIX}]", "action=validate")
    line = _one_error(code, err, "data.blend[1]")
    assert why in line, line
    assert line.endswith(f"try data.blend=[0.5,{PREFIX},0.5,{PREFIX}]"), line
    code, out, err = cli("recipe=smoke", *_hint(line), "action=validate")
    assert code == 0, err


def test_a_prefix_meaning_nothing_keeps_the_preprocessor_hint(cli, tmp_path):
    code, out, err = cli("recipe=smoke", f"data.blend=[{tmp_path / 'none'}]", "action=validate")
    line = _one_error(code, err, "data.blend[0]")
    assert "python -m data.preprocess" in line, line


def _preprocess(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "data.preprocess", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_preprocessor_output_prefix_ending_in_a_directory(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hello world"}\n')
    for prefix in (f"{tmp_path / 'out'}/", f"{tmp_path}/"):
        done = _preprocess("--input", str(src), "--tokenizer", str(DATA / "tokenizer.json"), "--output-prefix", prefix)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip() == (f"error: --output-prefix {prefix}: a prefix ends in a file name (the dataset "
                                       f"is PREFIX.bin and PREFIX.idx); try --output-prefix {prefix}corpus")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.parametrize("content,cause", [(b'{"text": "plain"}\n', "plain JSON text); rename it without .gz"),
                                           (b"PK\x03\x04zip", "starts with b'PK'")])
def test_preprocessor_input_named_gz_that_is_not_gzip(content, cause, tmp_path):
    src = tmp_path / "in.jsonl.gz"
    src.write_bytes(content)
    done = _preprocess("--input", str(src), "--tokenizer", str(DATA / "tokenizer.json"), "--output-prefix",
                       str(tmp_path / "out"))
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip()
    assert line.startswith(f"error: --input '{src}': named .gz but not gzip-compressed") and cause in line, line
    assert not list(tmp_path.glob("out*"))


# ---- meaning silently changed -------------------------------------------------------------------------------------

def _checkpoint(root: Path, step: int) -> Path:
    path = root / f"iter_{step:07d}"
    path.mkdir(parents=True)
    (path / "launcher.json").write_text(json.dumps({"step": step, "files": {}}))
    return path


@pytest.mark.parametrize("action", ["validate", "render"])
def test_checkpoint_dir_naming_one_checkpoint_is_refused(action, cli, tmp_path):
    older, newest = _checkpoint(tmp_path / "ck", 3), _checkpoint(tmp_path / "ck", 6)
    out_dir = tmp_path / "out"
    code, out, err = cli("recipe=smoke", f"checkpoint.dir={newest}", f"action={action}", f"output_dir={out_dir}")
    line = _one_error(code, err, "checkpoint.dir")
    assert "is a checkpoint itself (step 6)" in line and line.endswith(f"try checkpoint.dir={tmp_path / 'ck'}"), line
    code, out, err = cli("recipe=smoke", f"checkpoint.dir={older}", f"action={action}", f"output_dir={out_dir}")
    line = _one_error(code, err, "checkpoint.dir")
    assert line.endswith(f"try checkpoint.load={older} checkpoint.dir={tmp_path / 'ck' / 'continued'}"), line
    assert not out_dir.exists()
    code, out, err = cli("recipe=smoke", *_hint(line), "action=validate")
    assert code == 0, err


def test_a_dist_checkpointing_directory_as_checkpoint_dir_is_refused(cli, tmp_path):
    ckpt = tmp_path / "iter_0000010"
    ckpt.mkdir()
    (ckpt / "metadata.json").write_text("{}")
    code, out, err = cli("recipe=smoke", f"checkpoint.dir={ckpt}", "action=validate")
    line = _one_error(code, err, "checkpoint.dir")
    assert "a dist_checkpointing checkpoint" in line, line


def test_evaluation_without_a_validation_split_is_said(cli):
    code, out, err = cli("recipe=smoke", "train.eval_interval=5", "data.split='100,0,0'", "action=validate")
    assert code == 0
    assert ("warning: train.eval_interval=5: evaluation every 5 steps, but data.split='100,0,0' gives validation no "
            "share, so no evaluation would ever run; try train.eval_interval=0 or data.split='98,2,0'") in err, err
    code, out, err = cli("recipe=smoke", "train.eval_interval=5", "action=validate")
    assert "train.eval_interval" not in err, err


def test_a_script_path_built_from_pwd_names_the_directory_import_runs_from(tmp_path):
    fixture = (ROOT / "tests" / "fixtures" / "megatron_lm" / "llama3_8b_fp8_cp.sh").read_text()
    assert "CKPT_DIR=/lustre/ckpt/${RUN}" in fixture
    (tmp_path / "train.sh").write_text(fixture.replace("CKPT_DIR=/lustre/ckpt/${RUN}", "CKPT_DIR=$(pwd)/ckpt/${RUN}"))
    here = tmp_path / "elsewhere"
    here.mkdir()
    out = tmp_path / "out" / "recipes" / "recipe" / "mine.yaml"
    done = subprocess.run([sys.executable, "-m", "launcher", "import", "../train.sh", "--output", str(out)],
                          cwd=here, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert f"dir: {here}/ckpt/llama3_8b_fp8_cp" in text, text
    assert "mlm-import-" not in text
