"""Hugging Face in and out (launcher/hf): tiny random HF models (built from transformers' config classes, nothing
downloaded) -> import-hf -> a torch_dist checkpoint -> export-hf -> byte-identical tensors; the launcher's logits
(Megatron-Core, fp32, CPU) equal the HF model's; a model entry that differs from the HF config.json is refused with
one line per field; the streaming safetensors writer writes what safetensors writes."""
from __future__ import annotations

import gc
import json

import pytest

from _hf_tiny import ARCHS, NAMES, batch, hf_config, overrides, save_random

REL = 1e-5
"""Logits agreement, relative to the largest logit (fp32 on CPU)."""


def _tensors(root):
    import torch  # noqa: F401 - safetensors' torch framework
    from safetensors import safe_open

    out = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.fixture
def megatron_in_process(monkeypatch):
    """Megatron-Core in this process (world of one); its MoE metrics tracker is sized by the first model built, so
    it is dropped before and after (as tests/test_catalogue.py does)."""
    from megatron.core.transformer import multi_token_prediction
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from _rank_harness import single_process_group
    from models import cpu_compat, mtp

    single_process_group()
    if mtp.MTP_MODULE not in cpu_compat.PATCHED_MODULES:  # MTP's CPU bridge, as tests/test_catalogue.py's
        monkeypatch.setattr(multi_token_prediction, "torch", cpu_compat.TORCH_ON_CPU)
    monkeypatch.setattr(multi_token_prediction.MTPLossLoggingHelper, "tracker", {})
    destroy_moe_metrics_tracker()
    yield
    destroy_moe_metrics_tracker()
    gc.collect()


TE_NAMES = {
    # get_gpt_layer_with_transformer_engine_spec (megatron/core/models/gpt/gpt_layer_specs.py): a MoE layer's
    # pre-MLP norm is a TENorm of its own; a dense MLP's is fused into fc1 (TELayerNormColumnParallelLinear); MLA's
    # latent norms are fused into the up projections
    "mixtral": {"decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.1.pre_mlp_layernorm.weight"},
    "qwen3_moe": {"decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.1.pre_mlp_layernorm.weight",
                  "decoder.layers.0.self_attention.q_layernorm.weight"},  # per-head qk-norm: the same in both
    "deepseek_v3": {"decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.layers.1.pre_mlp_layernorm.weight",
                    "decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight",
                    "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.layer_norm_weight",
                    "mtp.layers.0.transformer_layer.pre_mlp_layernorm.weight"},
}


def megatron_logits(job, checkpoint, tokens):
    """The launcher's model at TP=PP=1, loaded from ``checkpoint`` as a job's ranks load it, on ``tokens``."""
    import torch
    from megatron.core import dist_checkpointing

    from launcher.hf.importer import build_single

    from _hf_tiny import sdpa_core_attention

    chunk = build_single(job, mla_core_attention=sdpa_core_attention())
    state = dist_checkpointing.load({"model": chunk.sharded_state_dict()}, str(checkpoint))
    chunk.load_state_dict(state["model"])
    chunk.eval()
    pos = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    with torch.no_grad():
        return chunk(tokens, pos, None)


def assert_logits_close(ours, theirs):
    import torch

    ours = ours[..., : theirs.shape[-1]]  # the padded vocabulary rows are not HF's
    err = float((ours - theirs).abs().max() / theirs.abs().max())
    assert err <= REL, f"launcher logits differ from HF's by {err:.2e} (relative to the largest logit)"
    # The same next token wherever the choice is clear: the two sides run different kernels (fused QKV vs q/k/v,
    # Megatron's attention vs HF's, TP-split GEMMs), so where the top two logits are closer than twice the error
    # bound a tie may break either way depending on the CPU; elsewhere the bound above implies the same argmax.
    m = theirs.abs().max()
    top2 = theirs.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * REL * m
    assert clear.float().mean() > 0.9, f"only {clear.float().mean():.0%} of positions have a clear top token"
    assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])


@pytest.mark.parametrize("name", NAMES)
def test_hf_import_export_round_trip_and_logits(name, tmp_path, megatron_in_process):
    """HF random model -> import-hf -> export-hf: the same tensor names, dtypes and bytes; the imported checkpoint's
    logits (Megatron-Core) equal the HF model's; the exported directory loads with AutoModelForCausalLM and gives
    the HF model's logits exactly (its config.json is right)."""
    import torch
    from transformers import AutoModelForCausalLM

    from launcher.config import compose_job
    from launcher.hf.export import export
    from launcher.hf.importer import import_hf

    hf = save_random(name, tmp_path / "hf")
    job = compose_job(overrides(name))
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ckpt", job, log=lambda _: None)
    tokens = batch()
    with torch.no_grad():
        theirs = hf(tokens).logits
    assert_logits_close(megatron_logits(job, ckpt, tokens), theirs)

    export(ckpt, tmp_path / "out", log=lambda _: None)
    before, after = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
    assert sorted(after) == sorted(before)
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype and after[key].shape == tensor.shape, key
        assert after[key].contiguous().view(torch.uint8).equal(tensor.contiguous().view(torch.uint8)), key
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(before)
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert type(back).__name__ == type(hf).__name__
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, theirs)
    # the same HF weights imported for a Transformer Engine job (its names for a few norms differ) export the same
    te = import_hf(tmp_path / "hf", tmp_path / "ckpt-te", job, log=lambda _: None, spec="te")
    from launcher.hf.torch_dist import Reader

    assert TE_NAMES.get(name, set()) <= set(Reader(te).meta), "not the Transformer Engine spec's names"
    export(te, tmp_path / "out-te", log=lambda _: None)
    again = _tensors(tmp_path / "out-te")
    assert sorted(again) == sorted(before) and all(again[k].equal(before[k]) for k in before)


def test_import_refuses_a_different_model_one_line_per_field(tmp_path, capsys):
    """Before anything is built or written: each differing field on its own line, naming our field, the HF value
    and the setting that matches it."""
    from launcher.hf import main

    hf_config("llama", hidden_size=96, num_key_value_heads=4, rms_norm_eps=1e-6, tie_word_embeddings=True,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}).save_pretrained(str(tmp_path / "hf"))
    rc = main(["import-hf", "--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt"), *overrides("llama")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not (tmp_path / "ckpt").exists()
    expected = ["model.hidden_size=64: the HF config.json has hidden_size=96; try model.hidden_size=96",
                "model.num_query_groups=2: the HF config.json has num_key_value_heads=4; try model.num_query_groups=4",
                "model.norm_epsilon=1e-05: the HF config.json has rms_norm_eps=1e-06; try model.norm_epsilon=1e-06",
                "model.tie_embeddings=False: the HF config.json has tie_word_embeddings=True; "
                "try model.tie_embeddings=True",
                "model.rotary_base=500000.0: the HF config.json has rope_theta=10000.0; try model.rotary_base=10000.0",
                "model.rope_scaling=True: the HF config.json has rope_type='default'; try model.rope_scaling=False"]
    assert lines == [f"error: {e}" for e in expected]


def test_import_accepts_the_matching_config_of_every_architecture():
    """The hand-written overrides of each tiny architecture compare clean (so the refusals above are about the
    changed fields alone), and a Qwen3 config against the Llama entry names the architecture."""
    from launcher.config import compose_job
    from launcher.hf import arch

    for name in NAMES:
        assert arch.compare(hf_config(name), compose_job(overrides(name)).model) == [], name
    lines = arch.compare(hf_config("qwen3"), compose_job(overrides("llama")).model)
    assert lines[0].startswith("model: the HF config.json is a 'qwen3' model, the model entry makes a 'llama' one")
    # sliding-window attention is not what Megatron-Core's causal attention computes: refused, not dropped
    for name, change in (("mixtral", {"sliding_window": 4096}), ("qwen3", {"use_sliding_window": True})):
        lines = arch.compare(hf_config(name, **change), compose_job(overrides(name)).model)
        assert lines and lines[0].startswith("the HF config.json has sliding_window=4096"), name


def test_export_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    from launcher.hf import main

    rc = main(["export-hf", "--checkpoint", str(tmp_path), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "not a torch_dist checkpoint" in err[0] and "DIR/iter_N" in err[0]
    rc = main(["export-hf", "--checkpoint", str(tmp_path)])
    assert rc == 2 and "--output is required" in capsys.readouterr().err


def test_streamed_shards_read_back_as_safetensors_writes_them(tmp_path):
    """The streaming writer (header from the plan, bytes one tensor at a time) against safetensors' own writer:
    the same tensors read back, in every dtype the export writes; shards split at the size limit."""
    import torch
    from safetensors.torch import load_file, save_file

    from launcher.hf.safetensors_out import ShardWriter, plan_shards

    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 5, generator=gen), "b.weight": torch.randn(7, generator=gen).to(torch.bfloat16),
               "c": torch.randn(2, 2, 2, generator=gen).to(torch.float16), "d": torch.randn((), generator=gen)}
    entries = [(k, v.shape, v.dtype) for k, v in tensors.items()]
    shards = plan_shards(entries, max_shard_bytes=64)
    assert [len(s) for s in shards] == [1, 3]  # 60 bytes fill the first; 14 + 16 + 4 the second
    for k, shard in enumerate(shards):
        writer = ShardWriter(tmp_path / f"{k}.safetensors", [entries[i] for i in shard])
        for i in shard:
            writer.write(entries[i][0], tensors[entries[i][0]])
        writer.close()
    save_file(tensors, str(tmp_path / "ref.safetensors"))
    ours = {**load_file(str(tmp_path / "0.safetensors")), **load_file(str(tmp_path / "1.safetensors"))}
    ref = load_file(str(tmp_path / "ref.safetensors"))
    assert ours.keys() == ref.keys() == tensors.keys()
    for k in tensors:
        assert ours[k].dtype == ref[k].dtype and torch.equal(ours[k], ref[k]), k


def test_a_weights_only_checkpoint_of_another_model_is_named_field_by_field():
    """checkpoint.load= of an import whose weight-shaping fields differ from the job's: each differing field named
    (a longer context or other dropout is no difference: those fields are not recorded)."""
    from launcher.core.checkpoint.weights import weights_mismatch

    manifest = {"weights_of": {"model.hidden_size": 64, "model.num_layers": 2, "model.tie_embeddings": False}}
    same = {"model.hidden_size": 64, "model.num_layers": 2, "model.tie_embeddings": False, "model.seq_length": 8192}
    assert weights_mismatch(manifest, same) is None
    other = {**same, "model.hidden_size": 128, "model.tie_embeddings": True}
    assert weights_mismatch(manifest, other) == ("its weights are of another model (model.hidden_size=64 there, 128 "
                                                 "here; model.tie_embeddings=False there, True here)")


def test_a_job_loading_an_import_of_another_model_is_refused_before_it_runs(tmp_path):
    """The login side reads the import's launcher.json: one problem per model field that shapes the weights and
    differs (here the width and the tied embeddings), each with the value that matches; a longer sequence is fine."""
    from launcher.config import compose_job
    from launcher.validate import validate

    (tmp_path / "launcher.json").write_text(json.dumps({"weights_only": True, "weights_of": {
        "model.hidden_size": 64, "model.tie_embeddings": False, "model.num_layers": 2}}))
    job = compose_job([*overrides("qwen3"), f"checkpoint.load={tmp_path}", "model.seq_length=64"])
    lines = [p.line() for p in validate(job) if p.field.startswith("model.") and "checkpoint.load" in p.rule]
    assert lines == [f"error: model.tie_embeddings=True: the weights of checkpoint.load={tmp_path} have "
                     "model.tie_embeddings=False; try model.tie_embeddings=False"]
    job = compose_job([*overrides("qwen3"), f"checkpoint.load={tmp_path}", "model.hidden_size=128"])
    assert [p.field for p in validate(job) if "checkpoint.load" in p.rule] == ["model.hidden_size",
                                                                              "model.tie_embeddings"]
