"""Memory model: Korthikanti activation coefficients, pipeline in-flight factors, optimizer bytes, stages."""
import pytest

from launcher.config import compose_job
from launcher.core import derive, padded_vocab, stage_layer_counts
from launcher.plan.memory import (GB, activation_formula_check, in_flight_microbatches, memory_per_stage,
                                  stage_params, static_bytes)

# A GPT-3-like layer (MHA, GELU, 4h MLP, dropout on) with Megatron's local (unfused) attention:
# the setting of Korthikanti et al. 2022, Table 2.
GPT = ["recipe=smoke", "model.activation=gelu", "model.num_query_groups=null", "model.hidden_size=1024",
       "model.num_attention_heads=16", "model.ffn_hidden_size=4096", "model.seq_length=2048",
       "model.hidden_dropout=0.1", "model.attention_dropout=0.1", "precision.dtype=bf16",
       "precision.transformer_engine=false", "parallel.pipeline=1"]


def _job(*extra):
    return compose_job([*GPT, *extra])


def test_unsharded_activations_are_34_plus_5as_over_h():
    job = _job("parallel.tensor=1", "train.recompute=none")
    a, s, h = 16, 2048, 1024
    assert activation_formula_check(job) == pytest.approx(34 + 5 * a * s / h)


@pytest.mark.parametrize("t", [2, 4])
def test_tp_sp_selective_is_34_over_t(t):
    job = _job(f"parallel.tensor={t}", "parallel.sequence_parallel=true", "train.recompute=selective")
    assert activation_formula_check(job) == pytest.approx(34 / t)


def test_tp_without_sp_keeps_10_unsharded():
    job = _job("parallel.tensor=4", "parallel.sequence_parallel=false", "train.recompute=selective")
    assert activation_formula_check(job) == pytest.approx(10 + 24 / 4)


def test_full_recompute_keeps_2sbh():
    assert activation_formula_check(_job("parallel.tensor=1", "train.recompute=full")) == pytest.approx(2)
    sp = _job("parallel.tensor=4", "parallel.sequence_parallel=true", "train.recompute=full")
    assert activation_formula_check(sp) == pytest.approx(2 / 4)


def test_context_parallel_divides_sequence():
    base = _job("parallel.tensor=1", "train.recompute=selective", "cluster=h100", "nodes=1")
    cp = _job("parallel.tensor=1", "train.recompute=selective", "cluster=h100", "nodes=1", "parallel.context=2")
    assert activation_formula_check(cp) == pytest.approx(activation_formula_check(base) / 2)


def _in_flight(overrides, stage):
    job = compose_job(["recipe=llama3_70b", *overrides])  # DP2, micro-batch 1: global batch 128 = 64 microbatches
    return in_flight_microbatches(job, derive(job), stage)


def test_in_flight_1f1b_zb_and_interleaved():
    one = ["schedule.kind=1f1b", "parallel.virtual_pipeline=null"]
    p = compose_job(["recipe=llama3_70b"]).parallel.pipeline
    assert [_in_flight(one, r) for r in range(p)] == [p - r for r in range(p)]
    assert _in_flight([*one, "train.global_batch_size=4"], 0) == 2  # fewer microbatches than stages
    assert _in_flight(["schedule.kind=zb_h1", "parallel.virtual_pipeline=null"], 0) <= p
    v = compose_job(["recipe=llama3_70b"]).parallel.virtual_pipeline  # PP4 VPP5 interleaved
    assert _in_flight([], 0) == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_distributed_optimizer_bytes_per_param():
    """bf16 weights (2) + fp32 grads (4) + (fp32 master + Adam) 12/d; 18 without the distributed optimizer."""
    job = compose_job(["recipe=llama3_8b", "+experiment=bf16", "precision.grad_reduce_in_fp32=true"])  # 8 GPUs, TP1 CP2 -> DP x CP = 8
    rp = stage_params(job, 0)
    sb = static_bytes(job, rp)
    per = (sb["weights"] + sb["grads"] + sb["optimizer"]) / rp.total
    assert per == pytest.approx(6 + 12 / 8)
    plain = compose_job(["recipe=llama3_8b", "+experiment=bf16", "precision.grad_reduce_in_fp32=true",
                         "parallel.distributed_optimizer=false"])
    sb = static_bytes(plain, rp)
    assert (sb["weights"] + sb["grads"] + sb["optimizer"]) / rp.total == pytest.approx(18)


def test_uneven_stages_and_first_last_differ():
    job = compose_job(["recipe=llama405b"])
    assert stage_layer_counts(job.parallel, job.model.num_layers) == [15, 16, 16, 16, 16, 16, 16, 15]
    stages = memory_per_stage(job)
    first, mid, last = stages[0], stages[3], stages[-1]
    assert first.parts["activations"] > mid.parts["activations"] > last.parts["activations"]
    assert last.parts["output_logits"] > 0 and first.parts["output_logits"] == 0
    emb = padded_vocab(job.model, 8) * job.model.hidden_size / 8
    per_layer = mid.params / 16
    assert first.params == pytest.approx(15 * per_layer + emb)  # input embedding on the first stage
    assert last.params == pytest.approx(15 * per_layer + emb + job.model.hidden_size)  # output layer + final norm
    assert last.in_flight == 1 and first.in_flight == 8


def test_model_params_llama3_8b():
    from launcher.plan.memory import param_count

    job = compose_job(["recipe=llama3_8b"])
    assert param_count(job.model)["total"] / 1e9 == pytest.approx(8.03, abs=0.01)


@pytest.mark.parametrize("recipe", ["llama3_8b", "llama3_70b", "llama405b"])
def test_published_layouts_fit_on_h200(recipe):
    job = compose_job([f"recipe={recipe}", "cluster=h200"])
    assert max(s.total for s in memory_per_stage(job)) <= job.cluster.gpu_memory_gb * GB


# NVIDIA's performance recipes run FP8 with FP8 parameters and bf16 gradient buffers (Megatron-Bridge
# mixed-precision configs: fp8_param_gather=True; perf overrides: grad_reduce_in_fp32=False). With those two
# settings the published layouts fit on 80 GB H100s; see launcher/plan/NOTES.md for the default case.
NVIDIA_PRECISION = ["precision.fp8_param=true", "precision.grad_reduce_in_fp32=false"]


@pytest.mark.parametrize("recipe", ["llama3_8b", "llama3_70b", "llama405b"])
def test_published_layouts_fit_on_h100_with_nvidia_precision(recipe):
    job = compose_job([f"recipe={recipe}", "cluster=h100", *NVIDIA_PRECISION])
    assert max(s.total for s in memory_per_stage(job)) <= job.cluster.gpu_memory_gb * GB


def test_precision_aware_optimizer_and_cpu_offload_bytes_per_param():
    """The precision-aware optimizer stores its moments and main weights in the asked dtypes (bf16 moments +
    fp16 main weights: 2+2+2 = 6 bytes over d instead of 12); the CPU offload keeps only (1 - fraction) of the
    optimizer state on the GPU. What the rank builds is tests/test_wiring.py's and test_optimizer_levers.py's."""
    base = ["recipe=llama3_8b", "+experiment=bf16", "precision.grad_reduce_in_fp32=true"]
    job = compose_job(base)
    rp = stage_params(job, 0)
    d = 8
    aware = compose_job([*base, "precision.precision_aware_optimizer=true", "precision.exp_avg_dtype=bf16",
                         "precision.exp_avg_sq_dtype=bf16", "precision.main_params_dtype=fp16"])
    assert static_bytes(aware, rp)["optimizer"] / rp.total == pytest.approx(6 / d)
    assert static_bytes(job, rp)["optimizer"] / rp.total == pytest.approx(12 / d)
    fp8_moments = compose_job([*base, "precision.precision_aware_optimizer=true", "precision.exp_avg_dtype=fp8",
                               "precision.exp_avg_sq_dtype=fp8"])
    assert static_bytes(fp8_moments, rp)["optimizer"] / rp.total == pytest.approx((1 + 1 + 4) / d)
    off = compose_job([*base, "precision.precision_aware_optimizer=true", "train.optimizer_cpu_offload=true",
                       "train.optimizer_offload_fraction=0.75"])
    assert static_bytes(off, rp)["optimizer"] / rp.total == pytest.approx(12 / d * 0.25)
    assert static_bytes(off, rp)["weights"] == static_bytes(job, rp)["weights"]


def test_cuda_graph_buffers_per_graphed_callable():
    """CUDA graphs add two static hidden-size buffers (the backward graph's gradient input and output) per graphed
    callable of the stage, shared by its microbatches: the whole layer is one callable, [attn,moe_router] two.
    What the rank builds is tests/test_wiring.py's (TransformerConfig)."""
    base = ["recipe=qwen3_30b_a3b"]
    job = compose_job(base)
    lay = derive(job)
    assert lay.pp > 1 and all(s.parts["cuda_graphs"] == 0 for s in memory_per_stage(job, lay))
    graphed = compose_job([*base, "train.cuda_graph_impl=transformer_engine",
                           "train.cuda_graph_modules=[attn,moe_router,moe_preprocess]"])
    m, t = graphed.model, graphed.train
    sp = lay.tp if lay.sequence_parallel else 1
    hidden = 2 * m.hidden_size * t.micro_batch_size * m.seq_length / lay.cp / sp
    for stage in memory_per_stage(graphed, lay):  # every layer is MoE: attention + the router part, 2 callables
        assert stage.parts["cuda_graphs"] == pytest.approx(2 * hidden * 2 * stage.layers)
    plain = {s.stage: s for s in memory_per_stage(job, lay)}
    for stage in memory_per_stage(graphed, lay):  # nothing else moves
        assert stage.total - stage.parts["cuda_graphs"] == pytest.approx(plain[stage.stage].total)
    # a dense model's whole layer is one callable
    dense = compose_job(["recipe=llama3_8b", "train.cuda_graph_impl=local"])
    dl = derive(dense)
    [stage] = memory_per_stage(dense, dl)
    dm, dt = dense.model, dense.train
    dsp = dl.tp if dl.sequence_parallel else 1
    assert stage.parts["cuda_graphs"] == pytest.approx(
        2 * (2 * dm.hidden_size * dt.micro_batch_size * dm.seq_length / dl.cp / dsp) * dm.num_layers)
    attn = compose_job(["recipe=llama3_8b", "train.cuda_graph_impl=local", "train.cuda_graph_modules=[attn]"])
    assert memory_per_stage(attn, dl)[0].parts["cuda_graphs"] == pytest.approx(stage.parts["cuda_graphs"])
    both = compose_job(["recipe=llama3_8b", "train.cuda_graph_impl=local", "train.cuda_graph_modules=[attn,mlp]"])
    assert memory_per_stage(both, dl)[0].parts["cuda_graphs"] == pytest.approx(2 * stage.parts["cuda_graphs"])
