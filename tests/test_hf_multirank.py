"""Hugging Face in and out at TP2 x PP2 for every catalogue architecture (issue 23's gate), in one 4-rank launch:

- a tiny random HF model of each architecture -> ``import-hf`` (written at TP=1) -> loaded by 4 ranks through a
  job's ``checkpoint.load`` path at TP2 x PP2 (the MoE ones, Qwen3-MoE, Mixtral and DeepSeek-V3, at
  TP2 x PP2 x EP2 with expert TP 1 and sequence parallelism) -> the launcher's logits equal the HF model's
  (fp32, CPU, 1e-5 relative to the largest logit);
- the ranks train one step at that layout with the job's own step (pipeline schedule, DDP, Adam) and save ->
  ``export-hf`` -> AutoModelForCausalLM on the export gives the trained ranks' logits;
- the checkpoint of a real TP2 x PP2 training run (the session's shared reference run, which
  tests/test_checkpoint_reshard.py trains) exports to an HF model whose logits are the launcher's on that checkpoint.

One worker launch (tests/_hf_multirank_worker.py) loops over the six architectures; the imports and the launch are
one module-scoped fixture, the checks read its files.
"""
from __future__ import annotations

import json

import pytest

from _hf_tiny import NAMES, batch, overrides, save_random
from _rank_harness import ROOT, TINY, layout, run_worker, write_bundle
from test_hf import _tensors, assert_logits_close, megatron_in_process, megatron_logits  # noqa: F401 - a fixture

MOE = ("deepseek_v3", "mixtral", "qwen3_moe")
TRAIN = ["train.micro_batch_size=2", "train.global_batch_size=2", "train.train_steps=1", "train.warmup_steps=0",
         "train.lr=1e-2", "train.eval_interval=0", "logging.tensorboard=false"]
"""One step of the batch (2 sequences, one microbatch), at full learning rate from the first step."""


def job_layout(name: str) -> list:
    if name in MOE:  # EP2 on 4 ranks beside TP2 x PP2: expert TP 1 (MoE with TP needs sequence parallelism)
        return [*layout(tp=2, pp=2, ep=2), "parallel.expert_tensor=1", "parallel.sequence_parallel=true"]
    return layout(tp=2, pp=2)


def _import_all(root):
    """Per architecture: a random HF model, its import for the job at its layout, the job's bundle."""
    import torch

    from launcher.config import compose_job
    from launcher.hf.importer import import_hf

    tokens, plan, hf = batch(), [], {}
    for name in NAMES:
        job = [*overrides(name), *job_layout(name), *TRAIN]
        hf[name] = save_random(name, root / "hf" / name)
        bundle = write_bundle(root / "bundle" / name, job, nproc=4)
        torch.save(tokens, bundle / "tokens.pt")
        imported = import_hf(root / "hf" / name, root / "import" / name,
                             compose_job([*job, "cluster.gpus_per_node=4"]), log=lambda _: None)
        plan.append([name, str(bundle), str(imported)])
    (root / "plan.json").write_text(json.dumps(plan))
    return hf, tokens


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The imports (in this process) and the one 4-rank launch; yields (root, {name: HF model}, tokens)."""
    import gc

    from megatron.core.transformer import multi_token_prediction
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from _rank_harness import single_process_group
    from models import cpu_compat, mtp

    root = tmp_path_factory.mktemp("hf-multirank")
    with pytest.MonkeyPatch.context() as mp:  # test_hf.megatron_in_process, for the whole module
        single_process_group()
        if mtp.MTP_MODULE not in cpu_compat.PATCHED_MODULES:
            mp.setattr(multi_token_prediction, "torch", cpu_compat.TORCH_ON_CPU)
        mp.setattr(multi_token_prediction.MTPLossLoggingHelper, "tracker", {})
        destroy_moe_metrics_tracker()
        hf, tokens = _import_all(root)
        destroy_moe_metrics_tracker()
        gc.collect()
    proc = run_worker(ROOT / "tests" / "_hf_multirank_worker.py", [root / "ranks", root / "plan.json"], 4,
                      "the HF multi-rank worker (six architectures at TP2 x PP2)")
    assert proc.returncode == 0, f"the ranks failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    yield root, hf, tokens


def _logits(root, name):
    import torch

    return torch.load(root / "ranks" / name / "logits.pt")


@pytest.mark.parametrize("name", NAMES)
def test_import_loaded_at_tp2_pp2_gives_the_hf_logits(name, ranks):
    """The import, resharded by checkpoint.load to TP2 x PP2 (x EP2 for MoE): the ranks' logits are HF's."""
    import torch

    root, hf, tokens = ranks
    got = _logits(root, name)
    assert got["tp_pp_ep_etp"] == ((2, 2, 2, 1) if name in MOE else (2, 2, 1, 2)), "not the layout asked for"
    with torch.no_grad():
        theirs = hf[name](tokens).logits
    assert_logits_close(got["import"], theirs)


@pytest.mark.parametrize("name", NAMES)
def test_export_of_a_step_trained_at_tp2_pp2_gives_the_ranks_logits(name, ranks, tmp_path):
    """The checkpoint the ranks saved after one training step at the job's layout -> export-hf: the HF tensor names
    of the original model, changed weights, and AutoModelForCausalLM's logits on the export equal the ranks'."""
    import torch
    from transformers import AutoModelForCausalLM

    from launcher.hf.export import export

    root, hf, tokens = ranks
    got = _logits(root, name)
    assert not torch.allclose(got["trained"], got["import"], rtol=0, atol=1e-4), "the step changed nothing"
    report = export(root / "ranks" / name, tmp_path / "out", log=lambda _: None)  # its newest checkpoint
    assert report["checkpoint"] == str(root / "ranks" / name / "iter_0000001")
    original, exported = _tensors(root / "hf" / name), _tensors(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    changed = [k for k in original if not torch.equal(original[k], exported[k])]
    assert len(changed) > len(original) // 2, f"only {len(changed)} of {len(original)} tensors changed"
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert type(back).__name__ == type(hf[name]).__name__
    with torch.no_grad():
        assert_logits_close(got["trained"], back(tokens).logits)


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
