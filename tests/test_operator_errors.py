"""What a hostile but realistic operator hits, each ending in one line and no traceback (issue 27 items 4 and 5):
an empty dataset in the blend, the preprocessor on an empty input or an unwritable prefix, two launches in the
same second, a 300-character run name, a .bin truncated after render, a non-finite learning rate, checks that
render made and validate did not, and out-of-memory hints that only suggest what the job does not have yet."""
from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from launcher.config import compose_job

SHIPPED = ROOT / "data" / "assets" / "smoke_text_document"


def _empty_dataset(prefix: Path) -> Path:
    """What the preprocessor wrote for an empty input before the fix: an index of 0 documents, an empty .bin."""
    header = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + bytes([8]) + struct.pack("<QQ", 0, 1)
    Path(str(prefix) + ".idx").write_bytes(header + struct.pack("<q", 0))
    Path(str(prefix) + ".bin").write_bytes(b"")
    return prefix


def _no_traceback(out: str, err: str) -> None:
    assert "Traceback" not in out + err, (out + err)[-3000:]


def _same_line_from_validate_and_render(cli, overrides) -> dict:
    """Both refuse (exit 2, no traceback) with the same single error line: {action: [error lines]}."""
    said = {}
    for action in ("validate", "render"):
        code, out, err = cli(*overrides, f"action={action}")
        _no_traceback(out, err)
        assert code == 2, (action, out, err)
        said[action] = [x for x in err.splitlines() if x.startswith("error:")]
    assert said["validate"] == said["render"] and len(said["validate"]) == 1, said
    return said


@pytest.mark.parametrize("action", ["validate", "render"])
def test_an_empty_dataset_in_the_blend_is_one_line(cli, tmp_path, action):
    empty = _empty_dataset(tmp_path / "empty_text_document")
    code, out, err = cli(f"data.blend=[0.5,{SHIPPED},0.5,{empty}]", f"output_dir={tmp_path / 'runs'}",
                         f"action={action}")
    _no_traceback(out, err)
    assert code == 2, (out, err)
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert lines == [f"error: data.blend[3]='{empty}': the dataset is empty (0 documents, 0 tokens: its input had no "
                     "text); try remove it from data.blend, or re-run python -m data.preprocess on an input with "
                     "documents"], err


def test_the_preprocessor_refuses_an_empty_input_and_writes_nothing(tmp_path, capsys):
    from data.preprocess import main

    (tmp_path / "empty.jsonl").write_text("")
    code = main(["--input", str(tmp_path / "empty.jsonl"), "--tokenizer", str(ROOT / "data/assets/tokenizer.json"),
                 "--output-prefix", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip() == (f"error: --input {tmp_path / 'empty.jsonl'}: no text in 1 file(s) (0 document(s) under "
                           f"key 'text', 0 tokens); nothing was written to {tmp_path / 'out'}.bin/.idx; check --input "
                           "and --json-key")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]


def test_the_preprocessor_names_an_unwritable_output_prefix(tmp_path, capsys):
    from data.preprocess import main

    (tmp_path / "one.jsonl").write_text('{"text": "hello"}\n')
    code = main(["--input", str(tmp_path / "one.jsonl"), "--tokenizer", str(ROOT / "data/assets/tokenizer.json"),
                 "--output-prefix", "/proc/x/out", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == ("error: --output-prefix /proc/x/out: /proc/x is not writable (No such file or directory); "
                           "choose a directory you can write to")


def test_two_launches_in_the_same_second_get_two_bundles(tmp_path, monkeypatch):
    """Both launches pick the same <name>-<stamp>; the second one's rename finds it taken (ENOTEMPTY: the first
    launch's bundle is there) and renders again under the next free name, instead of a traceback."""
    import errno

    from launcher import render

    job = compose_job(["recipe=smoke", f"output_dir={tmp_path}"])
    first = render.write_bundle(job, argv=[])
    original_dir, original_rename, calls = render.new_bundle_dir, render.os.rename, []

    def same_second(job, now=None):  # the name the other launch took, as it was still free when computed
        return first.path if not calls else original_dir(job, now)

    def rename(src, dst):
        calls.append(dst)
        if len(calls) == 1:
            raise OSError(errno.ENOTEMPTY, "Directory not empty", str(dst))
        return original_rename(src, dst)

    monkeypatch.setattr(render, "new_bundle_dir", same_second)
    monkeypatch.setattr(render.os, "rename", rename)
    monkeypatch.setattr(render.Path, "exists", lambda self: False if self == first.path else os.path.exists(self))
    second = render.write_bundle(job, argv=[])
    assert len(calls) >= 2 and second.path != first.path, calls
    assert f"BUNDLE={second.path}" in second.launch.read_text() and f"BUNDLE={first.path}" in first.launch.read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directories left behind"


@pytest.mark.parametrize("action", ["validate", "render"])
def test_a_300_character_run_name_is_refused_in_one_line(cli, tmp_path, action):
    code, out, err = cli("name=" + "a" * 300, f"output_dir={tmp_path}", f"action={action}")
    _no_traceback(out, err)
    assert code == 2
    assert [x for x in err.splitlines() if x.startswith("error:")] == [
        f"error: name='{'a' * 300}': run names are at most 128 characters (the bundle directory <name>-<UTC stamp> "
        "must fit a file name's 255 bytes, the Slurm job name stays readable); try name=" + "a" * 40]
    assert not list(tmp_path.glob("*"))


def test_a_bin_truncated_after_render_is_named_on_the_ranks(tmp_path):
    from launcher.rank.datasets import DataFilesChanged, check_files

    for ext in (".bin", ".idx"):
        shutil.copy(str(SHIPPED) + ext, tmp_path / f"d{ext}")
    job = compose_job(["recipe=smoke", f"data.blend=[{tmp_path / 'd'}]"])
    check_files(job.data)  # intact: nothing to say
    size = os.path.getsize(tmp_path / "d.bin")
    os.truncate(tmp_path / "d.bin", size // 2)
    with pytest.raises(DataFilesChanged) as caught:
        check_files(job.data)
    assert str(caught.value) == (
        f"data.blend='{tmp_path / 'd'}': {tmp_path / 'd.bin'} is {size // 2:,} bytes but d.idx describes "
        f"{size // 2:,} uint16 tokens = {size:,} bytes (changed since the data pre-flight: truncated, rewritten or "
        "removed); restore the files or rebuild them with python -m data.preprocess, then run again")
    os.remove(tmp_path / "d.idx")
    with pytest.raises(DataFilesChanged, match=rf"{tmp_path / 'd.idx'} is missing"):
        check_files(job.data)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_a_non_finite_learning_rate_is_refused_by_validate(cli, value):
    code, out, err = cli(f"train.lr={value}", "action=validate")
    assert code == 2
    assert [x for x in err.splitlines() if x.startswith("error:")][0].startswith("error: train.lr=")
    assert "must be a finite number" in err and "non-finite loss" not in err


@pytest.mark.parametrize("case", ["slurm time", "checkpoint dir", "output dir"])
def test_validate_refuses_what_render_would_refuse(cli, tmp_path, case):
    """The same one line from validate as from render (item 5): a time limit too short for the derived signal lead
    (the 405B's save takes ~90 s), a checkpoint dir or output dir that takes no file."""
    overrides = {"slurm time": ["recipe=llama405b", "cluster=h100", "nodes=64", "slurm.time=00:05:00",
                                f"output_dir={tmp_path}"],
                 "checkpoint dir": ["checkpoint.dir=/proc/x/ckpt", f"output_dir={tmp_path}"],
                 "output dir": ["output_dir=/proc/x/runs"]}[case]
    said = _same_line_from_validate_and_render(cli, overrides)
    field = {"slurm time": "slurm.time='00:05:00'", "checkpoint dir": "checkpoint.dir='/proc/x/ckpt'",
             "output dir": "output_dir='/proc/x/runs'"}[case]
    assert said["validate"][0].startswith(f"error: {field}: ") and "; try " in said["validate"][0]
    assert not [p for p in tmp_path.iterdir()], "render wrote a bundle"


def test_out_of_memory_hints_leave_out_what_the_job_has_already():
    from launcher.plan import oom_message, plan_job

    base = ["recipe=llama405b", "cluster=h100", "nodes=8", "parallel.context=1"]
    plan = plan_job(compose_job(base))
    assert not plan.fits
    told = oom_message(plan, compose_job(base))
    job = compose_job([*base, "precision.grad_reduce_in_fp32=false", "parallel.distributed_optimizer=true",
                       "train.recompute=full"])
    plan = plan_job(job)
    assert not plan.fits
    message = oom_message(plan, job)
    for setting in ("precision.grad_reduce_in_fp32=false", "parallel.distributed_optimizer=true",
                    "train.recompute=full"):
        assert setting not in message, message
    assert "largest contributors" in message and "  - " in message and told != message


@pytest.mark.parametrize("field", ["checkpoint.dir", "output_dir", "checkpoint.load", "data.cache_dir"])
def test_a_path_with_a_part_longer_than_a_file_name_is_one_line(cli, tmp_path, field):
    """A 300-character directory name in a path (a file name is at most 255 bytes): checkpoint.dir and output_dir
    gave an ENAMETOOLONG traceback from validate and render; checkpoint.load and data.cache_dir were valid and
    failed on the ranks. One line from both, naming the part, and an alternative that validates."""
    long = tmp_path / ("x" * 300) / "sub"
    overrides = [f"{field}={long}"] + ([f"output_dir={tmp_path / 'runs'}"] if field != "output_dir" else [])
    said = _same_line_from_validate_and_render(cli, overrides)
    hint = {"output_dir": "output_dir=runs"}.get(field, f"{field}=null")
    assert said["validate"][0] == (f"error: {field}='{long}': its part '{'x' * 20}...' is 300 bytes, and a file or "
                                   f"directory name is at most 255; try {hint}")


@pytest.mark.parametrize("value", ["a;b", "$(id)", "ü名前", "a\nb", "it's"])
def test_a_run_name_hydra_cannot_read_is_the_name_rule_in_one_line(cli, tmp_path, value):
    """Shell metacharacters, a newline or non-ASCII letters in name=: Hydra's grammar error ("LexerNoViableAltException:
    name=a;b ^ See https://hydra.cc/...") named no rule and no alternative; read as the quoted string it was meant
    to be, the name's own rule answers, with its checked alternative."""
    for action in ("validate", "render"):
        code, out, err = cli(f"name={value}", f"output_dir={tmp_path}", f"action={action}")
        _no_traceback(out, err)
        assert code == 2
        assert [x for x in err.splitlines() if x.startswith("error:")] == [
            f"error: name={value!r}: run names are letters, digits, '.', '_' and '-'; try name=my_run"], err
    assert not list(tmp_path.iterdir())


def test_a_value_hydra_cannot_read_unquoted_is_offered_quoted(cli):
    """A field that takes the string (model.name is free text): the line names the field and the grammar rule, and
    the alternative is the same value quoted for Hydra (and for the shell), which validates."""
    code, out, err = cli("model.name=tiny(v2)", "action=validate")
    assert code == 2
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert lines == ["error: model.name='tiny(v2)': Hydra's override grammar reads this value only inside quotes (it "
                     "holds a character an unquoted value may not: a space, ;()[]{}=,'\" or a non-ASCII letter); try "
                     "'model.name=\"tiny(v2)\"'"]
    assert cli('model.name="tiny(v2)"', "action=validate")[0] == 0


def test_a_number_hydra_cannot_read_is_the_field_type_line():
    from launcher.config import ConfigError, compose_dict

    with pytest.raises(ConfigError) as caught:
        compose_dict(["train.lr=1e-3;"])
    assert caught.value.problem.line() == ("error: train.lr='1e-3;': must be a number in (0, 1) (Adam's step size); "
                                           "try train.lr=0.003")


@pytest.mark.parametrize("weight", ["0", "-1", "nan"])
def test_a_blend_weight_that_is_not_positive_offers_the_blend_without_it(cli, tmp_path, weight):
    """A dataset weighted 0 (or negative, or nan): the alternative was prose ("remove the dataset from the blend or
    give it a positive weight"); it is now the blend without that dataset, checked like any alternative."""
    for ext in (".bin", ".idx"):
        shutil.copy(str(SHIPPED) + ext, tmp_path / f"other{ext}")
    code, out, err = cli(f"data.blend=[{weight},{SHIPPED},1,{tmp_path / 'other'}]", "action=validate")
    assert code == 2
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and lines[0].endswith(f"; try data.blend=[1,{tmp_path / 'other'}]"), lines


def test_a_checkpoint_load_that_does_not_exist_is_refused_by_validate_with_the_one_beside_it(cli, tmp_path):
    """Validate said valid and the ranks refused it after the model build. The alternative is checked: the newest
    complete checkpoint beside the missing path (a mistyped step), else null; nothing is refused while
    checkpoint.dir holds checkpoints of its own (resumed first; checkpoint.load is then never read)."""
    missing = tmp_path / "ckpt" / "iter_0000050"
    code, out, err = cli(f"checkpoint.load={missing}", f"output_dir={tmp_path}", "action=validate")
    _no_traceback(out, err)
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"error: checkpoint.load='{missing}': no such checkpoint or directory; try checkpoint.load=null (start from "
        "step 0)"), err
    for step in (20, 40):  # two complete checkpoints (a manifest with its files and step) beside the missing one
        (tmp_path / "ckpt" / f"iter_{step:07d}").mkdir(parents=True)
        (tmp_path / "ckpt" / f"iter_{step:07d}" / "launcher.json").write_text(json.dumps({"files": {}, "step": step}))
    code, out, err = cli(f"checkpoint.load={missing}", f"output_dir={tmp_path}", "action=render")
    assert code == 2 and err.strip().endswith(f"try checkpoint.load={tmp_path / 'ckpt' / 'iter_0000040'}"), err
    assert not list(tmp_path.glob("smoke-*")), "render wrote a bundle"
    code, out, err = cli(f"checkpoint.load={tmp_path / 'ckpt' / 'iter_0000040'}", f"output_dir={tmp_path}",
                         "action=validate")
    assert code == 0, err  # the alternative validates
    code, out, err = cli(f"checkpoint.load={missing}", f"checkpoint.dir={tmp_path / 'ckpt'}", "action=validate")
    assert code == 0, err  # checkpoint.dir's own checkpoints are resumed instead


def test_a_rank_that_crashes_natively_leaves_its_python_stack_in_its_log(tmp_path):
    """A segfault in a rank (seen once at load 30: an FSDP rank exited -11 with nothing in its log) leaves every
    thread's Python stack in <bundle>/logs/rank-N.log (launcher.rank.console.open_rank_log: faulthandler on fd 2),
    with the function that crashed named; the console (the caller's stdout) stays free of it."""
    code = (
        "import os, signal, sys\n"
        "from launcher.rank.console import open_rank_log\n"
        f"console, path = open_rank_log({str(tmp_path)!r}, 3)\n"
        "def inside_the_training_step():\n"
        "    os.kill(os.getpid(), signal.SIGSEGV)\n"
        "inside_the_training_step()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGSEGV
    log = (tmp_path / "logs" / "rank-3.log").read_text()
    assert "Fatal Python error: Segmentation fault" in log and "inside_the_training_step" in log, log
    assert "Segmentation fault" not in proc.stdout
