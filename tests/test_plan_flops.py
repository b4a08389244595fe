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


@pytest.mark.parametrize("model,extra,expected", CASES)
def test_flops_per_token_equals_megatrons_own_function(model, extra, expected):
    """The reference values above, recomputed by Megatron-LM's ``num_floating_point_operations`` (shipped in the
    megatron-core wheel as ``megatron.training``) on the job as ``action=megatron-args`` exports it."""
    from launcher.megatron_lm.export import to_args
    from test_megatron_lm import megatron_or_skip

    parser, megatron_flops = megatron_or_skip()
    job = compose_job(["recipe=smoke", f"model={model}", *extra])
    exported = to_args(job)
    assert exported.not_expressible == []
    a = parser.parse_args(exported.args)
    h, n = a.hidden_size, a.num_attention_heads
    a.ffn_hidden_size = a.ffn_hidden_size or (int((4 * h * 2 / 3) / 64) * 64 if a.swiglu else 4 * h)
    a.kv_channels = a.kv_channels or h // n  # validate_args derives these two the same way
    a.padded_vocab_size = job.model.vocab_size  # unpadded, as our planner and NVIDIA's tables count
    theirs = megatron_flops(a, a.global_batch_size) / (a.global_batch_size * a.seq_length)
    assert flops_per_token(job.model) == pytest.approx(theirs, rel=1e-9)
    assert theirs / 1e9 == pytest.approx(expected, rel=5e-4)
