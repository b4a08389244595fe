"""checkpoint.load_hf=DIR: a job starts from Hugging Face weights. Rendering compares the HF config.json with the model
entry (one error per differing field, before anything is written) and imports it once with import-hf into
output_dir/hf-imports/ (reused by a job that would import the same tensors); the bundle's job then loads it as
checkpoint.load, the path every layout loads (tests/test_hf_multirank.py loads imports at TP2 x PP2 and EP2)."""
from __future__ import annotations

import json

from _hf_tiny import overrides, save_random

LAYOUT = ["parallel.tensor=2", "parallel.pipeline=1", "cluster.gpus_per_node=2"]


def _cli(capsys, *argv):
    from launcher.cli import main

    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_job_renders_from_hf_weights_through_one_reused_import(tmp_path, capsys):
    """render with checkpoint.load_hf: the import is written once under output_dir/hf-imports, the bundle's job has
    checkpoint.load on it (its recorded model is the job's); a second render reuses it; a job whose tensors or
    model entry differ (another vocabulary padding, dtype, RoPE base) has an import directory of its own."""
    from launcher.core import load_job

    save_random("llama", tmp_path / "hf")
    job = [*overrides("llama"), f"checkpoint.load_hf={tmp_path / 'hf'}", f"output_dir={tmp_path / 'runs'}",
           "action=render"]
    rc, out, err = _cli(capsys, *job, *LAYOUT)
    assert rc == 0, err
    [imported] = list((tmp_path / "runs" / "hf-imports").iterdir())
    final = imported / "iter_0000000"
    manifest = json.loads((final / "launcher.json").read_text())
    assert manifest["weights_only"] and manifest["source"] == str((tmp_path / "hf").resolve())
    assert manifest["weights_of"]["model.hidden_size"] == 64 and manifest["padded_vocab"] == 256
    [bundle] = [p for p in (tmp_path / "runs").iterdir() if (p / "config.yaml").is_file()]
    rendered = load_job(bundle / "config.yaml")
    assert rendered.checkpoint.load == str(final) and rendered.checkpoint.load_hf == str(tmp_path / "hf")

    rc, out, err = _cli(capsys, *job, *LAYOUT)
    assert rc == 0 and "is reused" in out, err
    assert list((tmp_path / "runs" / "hf-imports").iterdir()) == [imported]
    from launcher.preflight import hf_import_dir
    from launcher.config import compose_job

    assert hf_import_dir(compose_job([*job, *LAYOUT])) == imported
    for change in ("model.make_vocab_size_divisible_by=256", "precision.dtype=bf16", "model.rotary_base=10000"):
        assert hf_import_dir(compose_job([*job, *LAYOUT, change])) != imported, change


def test_a_model_entry_that_differs_from_the_hf_config_is_refused_field_by_field(tmp_path, capsys):
    """Before anything is imported or rendered: one line per differing field, each with the value that matches."""
    save_random("qwen3", tmp_path / "hf")
    rc, out, err = _cli(capsys, *overrides("qwen3"), f"checkpoint.load_hf={tmp_path / 'hf'}",
                        f"output_dir={tmp_path / 'runs'}", "action=render", "model.num_layers=4",
                        "model.rotary_base=10000", *LAYOUT)
    assert rc == 2
    assert [ln for ln in err.splitlines() if ln.startswith("error")] == [
        "error: model.num_layers=4: the HF config.json has num_hidden_layers=2; try model.num_layers=2",
        "error: model.rotary_base=10000.0: the HF config.json has rope_theta=1000000.0; try model.rotary_base=1000000.0"]
    assert not (tmp_path / "runs").exists()


def test_load_hf_is_refused_beside_load_and_without_a_config_json(tmp_path):
    """Login-node rules (no torch): one start only; a directory without config.json is no HF model."""
    from launcher.config import compose_job
    from launcher.validate import validate

    job = compose_job([*overrides("llama"), f"checkpoint.load_hf={tmp_path}", f"checkpoint.load={tmp_path}"])
    lines = [p.line() for p in validate(job) if p.field == "checkpoint.load_hf"]
    assert lines == [f"error: checkpoint.load_hf={str(tmp_path)!r}: a run starts from one thing; checkpoint.load="
                     f"{tmp_path} is set too; try checkpoint.load=null",
                     f"error: checkpoint.load_hf={str(tmp_path)!r}: names a Hugging Face model directory (config.json "
                     "and safetensors weights); no config.json there; try checkpoint.load_hf=null"]
