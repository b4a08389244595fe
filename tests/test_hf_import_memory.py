"""import-hf streams (issue 42): it checks free host memory and disk against its bound before a tensor is read and
refuses with one line when either is short, writing nothing; and a real import of a mid-sized model (~450 MB fp32) in
its own process peaks within the stated bound, far below the model's size (the importer before streaming held the
whole model, ~2.8x it). The memory figures are the child's own VmHWM (peak resident set, which starts afresh at
exec), not durations."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _hf_tiny import overrides, save_random
from _rank_harness import ROOT
from test_hf import megatron_in_process  # noqa: F401 - a fixture

MID = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
           num_key_value_heads=4, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-5,
           tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
MID_OURS = ["model.vocab_size=8192", "model.hidden_size=1024", "model.ffn_hidden_size=2816", "model.num_layers=8",
            "model.num_attention_heads=8", "model.num_query_groups=4", "model.seq_length=4096",
            "model.norm_epsilon=1e-5", "model.rotary_base=500000", "model.tie_embeddings=false",
            "precision.dtype=fp32", "data=mock", "model.rope_scaling=false"]
"""A Llama of 8 layers (~47 MB each in fp32) and two 34 MB vocabulary tensors: its largest tensor group (an fc1:
gate + up, the fused tensor, a half) is about a sixth of the model, so holding the model shows plainly."""


@pytest.mark.parametrize("short", ["max_memory", "memory", "disk"])
def test_import_refuses_in_one_line_when_memory_or_disk_is_short(short, tmp_path, capsys, monkeypatch,
                                                                  megatron_in_process):  # noqa: F811
    """Too little memory (under --max-memory, or what the kernel says is available) or too little disk: one line
    naming what is short, how much is needed and what to try; no traceback, nothing written."""
    from launcher.hf import main, stream_in

    save_random("llama", tmp_path / "hf")
    argv = ["import-hf", "--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt"), *overrides("llama")]
    if short == "max_memory":
        argv += ["--max-memory", "1MB"]
    elif short == "memory":
        monkeypatch.setattr(stream_in, "available_memory", lambda: (10**6, "MemAvailable in /proc/meminfo"))
    else:
        monkeypatch.setattr(stream_in, "free_disk_bytes", lambda path: 10**6)
    capsys.readouterr()  # transformers' save progress
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    expected = {"max_memory": ("error: --max-memory 1000000: import-hf needs 0.", "; try --max-memory 1GB"),
                "memory": ("error: host memory=0.00 GB available (MemAvailable in /proc/meminfo): import-hf needs 0.",
                           "; try a node (or a Slurm --mem) with 0."),
                "disk": (f"error: --output {tmp_path / 'ckpt'}: 0.00 GB free on its filesystem, the checkpoint needs",
                         "; try an --output on a filesystem with 0.")}[short]
    assert lines[0].startswith(expected[0]) and expected[1] in lines[0], lines[0]
    assert not (tmp_path / "ckpt").exists() and "imported" not in out


@pytest.mark.parametrize("short", ["memory", "disk"])
def test_export_refuses_in_one_line_when_memory_or_disk_is_short(short, tmp_path, capsys, monkeypatch,
                                                                  megatron_in_process):  # noqa: F811
    """export-hf checks the same before it reads a tensor: too little host memory for its largest tensor group or
    too little disk for the HF files is one line naming what is short and what to try; nothing is written (no
    output, no temporary directory beside it)."""
    from launcher.hf import main, stream_in

    save_random("llama", tmp_path / "hf")
    assert main(["import-hf", "--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt"),
                 *overrides("llama")]) == 0
    if short == "memory":
        monkeypatch.setattr(stream_in, "available_memory", lambda: (10**6, "MemAvailable in /proc/meminfo"))
    else:
        monkeypatch.setattr(stream_in, "free_disk_bytes", lambda path: 10**6)
    capsys.readouterr()
    rc = main(["export-hf", "--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    expected = {"memory": ("error: host memory=0.00 GB available (MemAvailable in /proc/meminfo): export-hf needs 0.",
                           "; try a node (or --slurm with a Slurm --mem) with 0."),
                "disk": (f"error: --output {tmp_path / 'out'}: 0.00 GB free on its filesystem, the export needs",
                         "; try an --output on a filesystem with 0.")}[short]
    assert lines[0].startswith(expected[0]) and expected[1] in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"] and "exported" not in out


def test_import_peak_memory_stays_under_its_bound_far_below_the_model(tmp_path):
    """``python -m launcher import-hf`` of a ~450 MB fp32 model: the child's peak resident memory beyond what it held
    before reading a tensor (Python, torch, Megatron-Core, transformers, the meta model, the plan) is within the
    stated bound (largest tensor group + margin) and under half the model; the files it wrote hold the model."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**MID), dtype=torch.float32)
    hf.save_pretrained(str(tmp_path / "hf"))
    del hf
    proc = subprocess.run([sys.executable, "-m", "launcher", "import-hf", "--hf", str(tmp_path / "hf"), "--output",
                           str(tmp_path / "ckpt"), *MID_OURS], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("import-report ")]
    report = json.loads(line[len("import-report "):])
    model = report["model_bytes"]
    assert 420e6 < model < 480e6  # the model is what this test means it to be
    written = sum(p.stat().st_size for p in (tmp_path / "ckpt" / "iter_0000000").iterdir())
    assert written >= model
    grew = report["peak_rss_bytes"] - report["rss_before_reading_bytes"]
    assert report["peak_rss_bytes"] <= report["bound_bytes"], report
    assert grew < 0.5 * model, f"import-hf grew by {grew / 1e6:.0f} MB while importing a {model / 1e6:.0f} MB model"


def test_import_never_builds_where_cuda_is_visible(tmp_path, monkeypatch, capsys):
    """The CLI hides CUDA before torch is imported; a process that sees a GPU anyway (an in-process caller) is refused
    before anything is built, since Megatron-Core would create every weight on the GPU explicitly. And the CLI hides
    it: a fresh ``python -m launcher import-hf`` with CUDA_VISIBLE_DEVICES=0 runs with no device visible."""
    import torch

    from launcher.config import compose_job
    from launcher.hf.importer import ImportRefused, import_hf

    save_random("llama", tmp_path / "hf")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ImportRefused, match="CUDA is visible to this process: import-hf never uses a GPU"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt", compose_job(overrides("llama")), log=lambda _: None)
    assert not (tmp_path / "ckpt").exists()
    probe = ("import os, sys; from launcher.hf import _import\n"
             "try:\n    _import({'--hf': sys.argv[1], '--check': '1'}, [])\n"
             "finally:\n    print('CUDA_VISIBLE_DEVICES=' + repr(os.environ.get('CUDA_VISIBLE_DEVICES')))\n")
    import os

    proc = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "hf")], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    assert "CUDA_VISIBLE_DEVICES=''" in proc.stdout, proc.stdout + proc.stderr[-2000:]
