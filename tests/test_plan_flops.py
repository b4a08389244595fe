"""FLOPs per token reproduce Megatron-LM's num_floating_point_operations (reference values below)."""
import pytest

from launcher.config import compose_job
from launcher.core import derive, moe_layer_pattern
from launcher.core.flops import flops_per_step, flops_per_token

CASES = [
    # (model recipe, overrides, GFLOP/token from Megatron-LM's num_floating_point_operations)
    ("llama3_8b", [], 51.470),
    ("llama3_70b", [], 449.22),
    ("llama31_405b", [], 2523.96),
    ("deepseek_v3", [], 259.99),
    ("deepseek_v3", ["model.mtp_num_layers=0"], 249.81),
    ("qwen3_30b_a3b", [], 23.006),
    ("qwen3_235b_a22b", [], 148.03),
]


@pytest.mark.parametrize("model,extra,expected", CASES)
def test_flops_per_token_matches_megatron(model, extra, expected):
    job = compose_job(["recipe=smoke", f"model={model}", *extra])
    got = flops_per_token(job.model) / 1e9
    assert got == pytest.approx(expected, rel=5e-4)


def test_flops_per_step_is_tokens_times_per_token():
    job = compose_job(["recipe=llama3_8b"])
    tokens = job.train.global_batch_size * job.model.seq_length  # spelled out: this checks the Layout's count too
    assert derive(job).tokens_per_step == tokens
    assert flops_per_step(job.model, derive(job).tokens_per_step) == pytest.approx(flops_per_token(job.model) * tokens)


def test_deepseek_moe_pattern_first_three_dense():
    job = compose_job(["recipe=smoke", "model=deepseek_v3"])
    pattern = moe_layer_pattern(job.model)
    assert pattern[:3] == [False] * 3 and all(pattern[3:]) and len(pattern) == 61
