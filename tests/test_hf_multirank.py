"""Hugging Face in and out at TP2 x PP2, once, for the Llama family (one 4-rank run shared by both directions):

- ``import-hf`` of a tiny random Llama 3.1 (GQA, llama3 RoPE scaling) -> its checkpoint loaded by
  4 ranks at TP2 x PP2 as a job's ``checkpoint.load`` loads it -> the launcher's logits equal the HF model's;
- the ranks change every weight and save at TP2 x PP2 -> ``python -m launcher export-hf`` -> the exported tensors
  are exactly the changed HF tensors, and AutoModelForCausalLM on the export gives the ranks' logits;
- the checkpoint of a real TP2 x PP2 training run (the session's shared reference run, which
  tests/test_checkpoint_reshard.py trains) exports to an HF model whose logits are the launcher's on that checkpoint.
"""
from __future__ import annotations

import os
import subprocess
import sys

from _hf_tiny import batch, overrides, save_random
from _rank_harness import ROOT, TINY, communicate_on_progress, layout, run_worker, write_bundle
from test_hf import _tensors, assert_logits_close, megatron_in_process, megatron_logits  # noqa: F401 - a fixture


def _run(cmd, what: str, timeout: int = 300) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    out, err = communicate_on_progress(proc, timeout, what)
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{out[-2000:]}\n{err[-4000:]}"
    return out


def test_hf_logits_at_tp2_pp2_import_and_export(tmp_path, megatron_in_process):
    import torch
    from transformers import AutoModelForCausalLM

    from _hf_tp2pp2_worker import TRANSFORM

    hf = save_random("llama", tmp_path / "hf")
    job = [*overrides("llama"), *layout(tp=2, pp=2)]
    bundle = write_bundle(tmp_path / "bundle", job, nproc=4)
    tokens = batch()
    torch.save(tokens, bundle / "tokens.pt")
    from launcher.config import compose_job
    from launcher.hf.importer import import_hf

    imported = import_hf(tmp_path / "hf", tmp_path / "ckpt", compose_job([*job, "cluster.gpus_per_node=4"]),
                         log=lambda _: None)
    proc = run_worker(ROOT / "tests" / "_hf_tp2pp2_worker.py", [bundle, imported, tmp_path / "trained"], 4,
                      "the TP2 x PP2 HF worker")  # torchrun (or the session's warm rank server)
    assert proc.returncode == 0, f"the ranks failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    got = torch.load(tmp_path / "trained" / "logits.pt")
    with torch.no_grad():
        theirs = hf(tokens).logits
    assert_logits_close(got["import"], theirs)

    trained = tmp_path / "trained" / "iter_0000001"
    out = _run([sys.executable, "-m", "launcher", "export-hf", "--checkpoint", str(trained), "--output",
                str(tmp_path / "out")], "export-hf")
    assert "exported" in out
    original, exported = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor * TRANSFORM[0] + TRANSFORM[1]), key
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert_logits_close(got["changed"], back(tokens).logits)


def test_export_of_a_checkpoint_trained_at_tp2_pp2_gives_the_launchers_logits(tmp_path, reference_run,
                                                                            megatron_in_process):
    """6 real training steps at TP2 x PP2 (fp32; the run test_checkpoint_reshard trains, shared in the session) ->
    export-hf -> AutoModelForCausalLM: its logits equal the launcher's model loaded from that checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from launcher.core import load_job
    from launcher.hf.export import export

    run = reference_run(4, TINY + ["train.train_steps=6", "checkpoint.save_interval=3"] + layout(tp=2, pp=2)
                        + ["checkpoint.save_at_end=true"])
    saved = run.bundle / "checkpoints" / "iter_0000006"
    report = export(run.bundle / "checkpoints", tmp_path / "out", log=lambda _: None)  # the newest checkpoint
    assert report["checkpoint"] == str(saved)
    job = load_job(run.bundle / "config.yaml")
    assert job.precision.dtype == "fp32" and (job.parallel.tensor, job.parallel.pipeline) == (2, 2)
    tokens = batch(vocab=job.model.vocab_size, seq=job.model.seq_length)
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = back(tokens).logits
    assert_logits_close(megatron_logits(job, saved, tokens), theirs)
