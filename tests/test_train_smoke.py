"""The embedded smoke recipe trains (real data, TP2xPP2 on 4 CPU processes), logs Megatron-formula TFLOP/s,
and leaves its report, TensorBoard events and a published checkpoint in the bundle."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from _rank_harness import ROOT, TINY, layout, run_train, train, write_bundle


def megatron_flops_per_token(m) -> float:
    """Independent GEMM count (3 passes x 2 FLOP/FMA), causal attention halved, unpadded vocab: what
    Megatron's num_floating_point_operations gives per token for a dense GQA/SwiGLU model."""
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    g = m.num_query_groups or m.num_attention_heads
    a, h, s = m.num_attention_heads, m.hidden_size, m.seq_length
    mlp = (3 if m.activation == "swiglu" else 2) * h * m.ffn_hidden_size
    layer = h * (a + 2 * g) * d + s * a * d + a * d * h + mlp
    return 6.0 * (m.num_layers * layer + h * m.vocab_size)


def test_megatron_formula_reference_value():
    from launcher.config import compose_job

    # DESIGN.md: Llama3-8B at seq 8192 is 51.470 GFLOP/token with this formula
    assert megatron_flops_per_token(compose_job(["recipe=llama3_8b"]).model) / 1e9 == pytest.approx(51.470, abs=5e-4)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    # the default recipe (shipped corpus + tokenizer, TP2xPP2, 4 processes), shortened to 12 steps
    return train(tmp_path_factory.mktemp("smoke"), "smoke", 4,
                 ["train.train_steps=12", "train.eval_interval=6", "train.warmup_steps=2"])


def test_smoke_loss_decreases(smoke):
    losses = smoke.losses()
    assert sorted(losses) == list(range(1, 13))
    assert losses[12] < losses[1] - 1.0, losses
    assert [e["step"] for e in smoke.evals] == [6, 12]
    assert smoke.evals[1]["loss"] < smoke.evals[0]["loss"]
    assert "step    12 | loss" in smoke.stdout and "valid loss" in smoke.stdout


def test_smoke_tflops_use_megatron_formula(smoke):
    from launcher.config import load_job

    job = load_job(smoke.bundle / "config.yaml")
    fpt = megatron_flops_per_token(job.model)
    assert smoke.final["flops_per_token"] == pytest.approx(fpt, rel=1e-9)
    tokens = job.train.global_batch_size * job.model.seq_length
    for h in smoke.steps.values():
        expect = fpt * tokens / (h["ms_per_step"] / 1e3) / smoke.final["world_size"] / 1e12
        assert h["tflops"] == pytest.approx(expect, rel=1e-6)
        # CPU: utilisation against the measured per-rank share of the CPU's matmul peak, not a GPU peak
        assert h["mfu"] == pytest.approx(h["tflops"] / smoke.final["mfu_peak_tflops_per_rank"], rel=1e-9)
        assert h["tokens_per_s"] == pytest.approx(tokens / (h["ms_per_step"] / 1e3), rel=1e-6)
        assert 0 < h["mem_gib"] < 8
    assert smoke.final["mfu_basis"] == "util vs measured CPU share"
    assert 0 < smoke.final["mfu_peak_tflops_per_rank"] != job.cluster.peak_tflops_bf16
    assert "| util vs measured CPU share " in smoke.stdout and "MFU" not in smoke.stdout


CLEAN_LINE = re.compile(r"^(step +\d+ \| loss |eval +\d+ \| valid loss |saved checkpoint |resumed from |"
                        r"finished at step |stopped at step )")


def test_console_is_clean_and_every_rank_has_its_full_log(smoke):
    lines = [line for line in smoke.stdout.splitlines() if line.strip()]
    assert lines and all(CLEAN_LINE.match(line) for line in lines), [x for x in lines if not CLEAN_LINE.match(x)]
    assert lines[-1].startswith("finished at step 12 of 12")
    for rank in range(4):
        log = (smoke.bundle / "logs" / f"rank-{rank}.log").read_text()
        assert log.startswith(f"=== rank {rank} started")
    assert "step    12 | loss" in (smoke.bundle / "logs" / "rank-0.log").read_text()
    assert "GPTModel IS DEPRECATED" not in (smoke.bundle / "logs" / "rank-0.log").read_text()


def test_smoke_leaves_report_tensorboard_and_checkpoint(smoke):
    png = smoke.bundle / "report" / "training.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    for key in ("final_loss", "tokens_per_s", "tflops", "mfu", "peak_mem_gib", "final_valid_loss"):
        assert key in smoke.final
    assert smoke.final["status"] == "done" and smoke.final["steps"] == 12
    # every pipeline stage's peak (the largest of its TP ranks), gathered from all ranks: the GPU lane holds it
    # against the plan's per-stage memory
    stages = smoke.final["memory_by_stage"]
    assert [s["stage"] for s in stages] == [0, 1] and all(s["basis"] == "peak RSS" for s in stages)
    assert all(0 < s["peak_gib"] < 8 for s in stages) and {s["rank"] for s in stages} <= {0, 1, 2, 3}
    assert len({s["rank"] for s in stages}) == 2
    assert smoke.final["peak_mem_gib"] <= max(s["peak_gib"] for s in stages)  # rank 0's is one of them
    assert list((smoke.bundle / "tensorboard").glob("events.out.tfevents.*"))
    ckpt = smoke.bundle / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "iter_0000012"
    assert (ckpt / "iter_0000012" / "metadata.json").is_file()


def test_import_runs_nothing():
    code = "import sys, launcher.rank.entry, launcher.rank.__main__; assert 'torch' not in sys.modules and 'megatron' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_bad_layout_exits_nonzero_with_clear_error(tmp_path):
    bundle = write_bundle(tmp_path / "bad", TINY + layout(tp=2, pp=2) + ["train.train_steps=1"])
    proc = run_train(bundle, 1)
    assert proc.returncode != 0
    assert "world size 1 is not a multiple of tensor x pipeline x context = 4" in proc.stdout + proc.stderr


def test_the_default_runs_checkpoint_exports_and_generates_text_with_transformers(smoke, tmp_path):
    """Issue 23's gate for `make run`: its checkpoint (here the same job, 12 steps) -> export-hf -> transformers'
    AutoTokenizer and AutoModelForCausalLM load it from the directory alone and generate text on CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launcher.hf.export import export

    out = tmp_path / "hf"
    export(smoke.bundle / "checkpoints", out, log=lambda _: None)
    tok = AutoTokenizer.from_pretrained(str(out))  # the tokenizer the job trained with travels with the weights
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    prompt = tok("The kernel", return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id or 0)
    new = ids[0, prompt["input_ids"].shape[1]:]
    assert ids.shape[1] > prompt["input_ids"].shape[1] and int(new.max()) < len(tok), ids
    text = tok.decode(ids[0], skip_special_tokens=True)
    assert text.startswith("The kernel") and len(text) > len("The kernel"), text
