"""Fine-grained activation offloading (issue 41): train.activation_offload_modules / _fraction /
min_offloaded_tensor_size against Megatron-Core's own TransformerConfig, the planner's bytes and seconds, the job's
environment and the Megatron-LM round trip. GPU-only at run time (CUDA streams, pinned memory, TE's offload
module): here the config objects a GPU rank builds are built on CPU, as the wiring test does."""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from launcher.config import compose_job
from launcher.core import derive
from launcher.core.cuda_env import job_env
from launcher.plan import plan_job as plan
from launcher.plan.memory import (DTYPE_BYTES, GB, layer_activation_bytes_per_token, memory_per_stage,
                                  offloaded_bytes_per_token)
from launcher.plan.timing import step_time
from launcher.problems import errors
from launcher.schema import ACTIVATION_OFFLOAD_MODULES
from launcher.validate import raw_problems, validate
from test_wiring import gpu_rank  # noqa: F401  (the fixture: CUDA 'available', a stand-in transformer_engine)

DENSE = ["recipe=llama3_70b", "train.recompute=none"]
MOE = ["recipe=qwen3_30b_a3b"]
RECOMPUTES = [("none", []), ("selective", []), ("selective", ["layernorm"]), ("selective", ["moe_act"]),
              ("selective", ["moe"])]


def _with(job, **train):
    return dataclasses.replace(job, train=dataclasses.replace(job.train, **train))


def _megatron_core_accepts(job) -> tuple[bool, str]:
    """Megatron-Core's TransformerConfig built as a GPU rank builds it for ``job`` (its __post_init__ asserts)."""
    from models import builder

    tr = job.train
    try:
        builder.transformer_config(model=job.model, parallel=job.parallel, precision=job.precision, layout=derive(job),
                                   schedule=job.schedule, recompute=tr.recompute,
                                   recompute_num_layers=tr.recompute_num_layers, recompute_modules=tr.recompute_modules,
                                   activation_offload_modules=tr.activation_offload_modules,
                                   activation_offload_fraction=tr.activation_offload_fraction,
                                   min_offloaded_tensor_size=tr.min_offloaded_tensor_size)
    except (AssertionError, ValueError) as exc:
        return False, str(exc)
    return True, ""


@pytest.mark.parametrize("base", [DENSE, MOE], ids=["dense", "moe"])
def test_what_we_accept_megatron_core_builds_and_what_it_refuses_we_refuse(base, gpu_rank):  # noqa: F811
    """Every module set of up to three (and all of them) under five recompute settings: a job validation accepts
    builds its TransformerConfig, and one Megatron-Core's __post_init__ refuses is refused here first, on a line
    naming an offload field; ours refuses more (the stricter rules: modules that offload nothing in these layers)."""
    job = compose_job(base)
    sets = [list(c) for k in (1, 2, 3) for c in itertools.combinations(ACTIVATION_OFFLOAD_MODULES, k)]
    sets.append(list(ACTIVATION_OFFLOAD_MODULES))
    both_accept = upstream_refused = stricter = 0
    wrong = []
    for (rec, rmods), mods in itertools.product(RECOMPUTES, sets):
        case = _with(job, recompute=rec, recompute_modules=rmods, activation_offload_modules=mods)
        if errors(raw_problems(_with(case, activation_offload_modules=[]))):
            continue  # the recompute setting itself is invalid for this model (e.g. moe_act on a dense one)
        ours = errors(raw_problems(case))
        theirs, why = _megatron_core_accepts(case)
        if not ours and not theirs:
            wrong.append(f"{rec} {rmods} {mods}: accepted here, Megatron-Core refuses: {why}")
        elif ours and not any("offload" in p.field or "recompute" in p.field for p in ours):
            wrong.append(f"{rec} {rmods} {mods}: refused on another field: {[p.line() for p in ours]}")
        both_accept += not ours and theirs
        upstream_refused += not theirs
        stricter += bool(ours) and theirs
    assert not wrong, "\n".join(wrong[:10])
    assert both_accept >= 10 and upstream_refused >= 20 and stricter >= 20, (both_accept, upstream_refused, stricter)


def _activations(job) -> list[float]:
    return [s.parts["activations"] for s in memory_per_stage(job, derive(job))]


def test_offloading_frees_the_modules_saved_inputs_of_every_microbatch_in_flight_but_one_layer():
    """Llama3-70B's attention inputs (Q, K, V, its output and the LayerNormLinear's inputs, FP8 casts where TE keeps
    them): the GPU's activations fall by those bytes for every layer and microbatch in flight less one layer's (the
    group reloaded ahead of its backward); the host holds them instead."""
    job = compose_job(DENSE + ["train.activation_offload_modules=[qkv_linear,core_attn,attn_proj]"])
    plain = _with(job, activation_offload_modules=[])
    lay = derive(job)
    freed, host = offloaded_bytes_per_token(job, lay, False)
    m, a = job.model, DTYPE_BYTES[job.precision.dtype]
    tp, sp = lay.tp, lay.tp
    q = m.num_attention_heads * (m.hidden_size // m.num_attention_heads)
    kv = 2 * m.num_query_groups * (m.hidden_size // m.num_attention_heads)
    # qkv_linear: norm input (bf16) + FP8 GEMM input; core_attn: Q, K, V and O (bf16); attn_proj: O's FP8 cast
    assert freed == pytest.approx((a + 1) * m.hidden_size / sp + a * (q + kv) / tp + a * q / tp + 1 * q / tp)
    assert host == freed
    assert freed < layer_activation_bytes_per_token(plain, lay, False)
    tokens = job.train.micro_batch_size * m.seq_length / lay.cp
    for s, before, after in zip(memory_per_stage(job, lay), _activations(plain), _activations(job)):
        assert before - after == pytest.approx(freed * tokens * (s.layers * s.in_flight - 1))
        assert s.host_bytes == s.host["activations"] == pytest.approx(host * tokens * s.layers * s.in_flight)


def test_the_fraction_and_the_size_threshold_decide_what_leaves():
    """activation_offload_fraction scales what is freed; a min_offloaded_tensor_size above every tensor's elements
    frees nothing (Megatron-Core keeps smaller tensors on the GPU); the MoE modules move the routed tokens."""
    job = compose_job(MOE + ["train.activation_offload_modules=[expert_fc1,moe_act]"])
    lay = derive(job)
    full = offloaded_bytes_per_token(job, lay, True)[0]
    assert full > 0 and offloaded_bytes_per_token(job, lay, False) == (0.0, 0.0)  # no experts in a dense layer
    assert offloaded_bytes_per_token(_with(job, activation_offload_fraction=0.25), lay, True)[0] == \
        pytest.approx(full / 4)
    assert offloaded_bytes_per_token(_with(job, min_offloaded_tensor_size=1 << 40), lay, True) == (0.0, 0.0)
    # FP8: TE saves expert fc1's original bf16 input when it is offloaded, so the host holds more than the GPU frees
    freed, host = offloaded_bytes_per_token(_with(job, activation_offload_modules=["expert_fc1"]), lay, True)
    assert job.precision.fp8 and host == pytest.approx(2 * freed)


def test_the_copies_cost_time_only_beyond_the_compute_they_overlap():
    """Qwen3-30B-A3B's expert offload: at a tenth of the profile's PCIe rate the step grows by the exposed copies;
    a link fast enough that a layer's copy takes less than its forward and backward hides them entirely."""
    job = compose_job(MOE + ["train.activation_offload_modules=[expert_fc1,moe_act]"])
    lay = derive(job)
    base = step_time(_with(job, activation_offload_modules=[]), lay).step_s

    def at(gbps):
        j = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, host_bandwidth_gbps=gbps))
        return step_time(j, lay)
    fast, slow = at(1e6), at(5.0)
    assert fast.breakdown_s["offload"] == 0 and fast.step_s == pytest.approx(base, rel=1e-3)
    # at the profile's 50 GB/s a layer's copy outlasts its forward but not its forward + backward, which the copy
    # streams run beside in the steady state (PCIe is full duplex): hidden
    assert at(50.0).breakdown_s["offload"] == 0
    assert slow.breakdown_s["offload"] > 1.0 and slow.step_s > base + slow.breakdown_s["offload"] * 0.9


def test_the_plan_says_what_offloading_moves_and_it_makes_a_job_fit():
    """A Llama3-70B layout that does not fit without recompute fits with its attention inputs offloaded; the plan
    prints the modules, the host memory and the exposed PCIe time."""
    over = compose_job(DENSE + ["parallel.context=1"])
    fixed = _with(over, activation_offload_modules=["qkv_linear", "core_attn", "attn_proj"])
    assert not errors(validate(fixed))
    before, after = plan(over), plan(fixed)
    assert not before.fits and after.fits, (before.peak_gb, after.peak_gb)
    text = after._offload_text()
    assert "qkv_linear, core_attn, attn_proj" in text and "GB of pinned host memory" in text
    assert max(s.host_bytes for s in after.stages) / GB > 1


def test_the_jobs_environment_sets_what_megatron_lm_asserts():
    """NVTE_CPU_OFFLOAD_V1=1 with offloading (Megatron-LM asserts it for TE >= 2.10), absent without; a job's own
    value is kept and validated."""
    on = compose_job(MOE + ["train.activation_offload_modules=[expert_fc1]"])
    assert job_env(on)["NVTE_CPU_OFFLOAD_V1"] == "1"
    assert "NVTE_CPU_OFFLOAD_V1" not in job_env(compose_job(MOE))
    bad = compose_job(MOE + ["train.activation_offload_modules=[expert_fc1]", "+cluster.env.NVTE_CPU_OFFLOAD_V1=0"])
    assert job_env(bad)["NVTE_CPU_OFFLOAD_V1"] == "0"
    assert any(p.field == "cluster.env.NVTE_CPU_OFFLOAD_V1" for p in errors(validate(bad)))


def test_the_optimizer_cpu_offload_pays_its_pcie_copies():
    """train.optimizer_cpu_offload (the other offload lever): the host's share of each rank's optimizer shard crosses
    PCIe twice a step (main gradients down, main parameters up) with nothing to hide behind; the overlap flag
    pipelines the two directions; the device's optimizer step shrinks to its share."""
    from launcher.plan.memory import optimizer_shards, stage_params

    base = compose_job(["recipe=llama3_8b", "precision.precision_aware_optimizer=true"])
    lay = derive(base)
    dense, expert = optimizer_shards(base, lay)
    rp = stage_params(base, 0, lay)
    shard = rp.dense / dense + rp.expert / expert
    bw = base.cluster.host_bandwidth_gbps * 1e9
    plain = step_time(base, lay)
    for fraction, overlap in ((1.0, False), (0.5, False), (1.0, True)):
        job = _with(base, optimizer_cpu_offload=True, optimizer_offload_fraction=fraction,
                    overlap_cpu_optimizer_d2h_h2d=overlap)
        copies = shard * fraction * 4 * (1 if overlap else 2) / bw  # fp32 main parameters and gradients
        st = step_time(job, lay)
        assert st.optimizer_s == pytest.approx(plain.optimizer_s * (1 - fraction) + copies)
        assert st.step_s == pytest.approx(plain.step_s - plain.optimizer_s + st.optimizer_s)


@pytest.mark.parametrize("extra,modules,statuses", [
    (["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "expert_fc1",
      "--activation-offload-fraction", "0.5"], ["core_attn", "expert_fc1"], ["mapped", "mapped", "mapped"]),
    (["--offload-modules", "core_attn"], None, ["ignored"]),  # Megatron-LM reads the list only with the switch
    (["--fine-grained-activation-offloading"], None, ["unsupported"]),  # TransformerConfig asserts a module list
    (["--activation-offload-fraction", "0.5"], None, ["ignored"]),
])
def test_megatron_lm_offload_arguments_import_as_megatron_lm_reads_them(extra, modules, statuses):
    from launcher.megatron_lm.translate import to_fields

    base = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
            "--max-position-embeddings", "128", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--train-iters", "10", "--lr", "1e-4", "--bf16", "--mock-data"]
    values, report = to_fields(base + extra)
    assert values.get("train.activation_offload_modules") == modules
    assert [e.status for e in report if "offload" in e.flag] == statuses


def test_every_search_candidate_validates_and_some_offload():
    """The search's offload candidates (and their CUDA-graph twins, where TE graphs cannot hold the offloaded
    modules) pass the launcher's whole validation, not only the layout rules it re-checks itself."""
    from launcher.plan.search import search

    args = ["recipe=deepseek_v3"]  # memory-bound on H100: offloading layouts lead, one with a graphed twin
    found = search(compose_job(args), top=40)
    offloading = [c for c in found if "train.activation_offload_modules=[expert_fc1,moe_act]" in c.overrides]
    assert offloading, [c.overrides for c in found]
    assert all("activation offload holds" in c.why for c in offloading)
    wrong = [(c.overrides, [p.line() for p in errors(validate(compose_job(args + c.overrides)))]) for c in found]
    assert not [w for w in wrong if w[1]], [w for w in wrong if w[1]][:3]


def test_a_candidate_that_breaks_a_rule_the_job_keeps_is_not_returned(monkeypatch):
    """The search's safety net: with the graph twin's offload check taken away (a rule gap), the twin that breaks
    validate_activation_offload is still not returned, because a candidate may not add errors the job lacks."""
    from launcher.plan import search as search_module

    monkeypatch.setattr(search_module, "validate_activation_offload", lambda job, lay: [])
    args = ["recipe=deepseek_v3"]
    found = search_module.search(compose_job(args), top=40)
    assert found and not [c.overrides for c in found if errors(validate(compose_job(args + c.overrides)))]


def test_host_memory_counts_every_offload_and_the_plan_warns_past_the_node():
    """The host side of both offload levers: the optimizer CPU offload's share of the rank's optimizer shard holds
    its main parameter, a gradient copy and two moments on the host (HybridDeviceOptimizer); activation offloading
    its pinned tensors. Past cluster.host_memory_gb the plan says so, naming each part per node."""
    from launcher.plan.memory import optimizer_shards, stage_params

    job = compose_job(MOE + ["train.activation_offload_modules=[expert_fc1]", "precision.precision_aware_optimizer=true",
                             "train.optimizer_cpu_offload=true", "train.optimizer_offload_fraction=0.5"])
    lay = derive(job)
    dense, expert = optimizer_shards(job, lay)
    stages = memory_per_stage(job, lay)
    for s in stages:
        rp = stage_params(job, s.stage, lay)
        assert s.host["optimizer"] == pytest.approx((rp.dense / dense + rp.expert / expert) * 0.5 * (4 + 4 + 4 + 4))
        assert s.host_bytes == pytest.approx(s.host["optimizer"] + s.host["activations"])
    assert not any("host memory per node" in w for w in plan(job).warnings)
    busiest = max(s.host_bytes for s in stages) * job.cluster.gpus_per_node / GB
    small = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, host_memory_gb=busiest * 0.99))
    [warning] = [w for w in plan(small).warnings if "host memory per node" in w]
    assert "activations" in warning and "optimizer" in warning


def test_the_copies_share_the_pcie_link_with_the_inter_node_expert_traffic(monkeypatch):
    """DeepSeek-V3 (EP64 over 8 nodes): the GPU's PCIe link also carries its GPUDirect network traffic, the
    inter-node dispatch and combine of every layer; the copies' exposed time is what they add beyond that traffic,
    so it grows with it (and is none where no expert traffic leaves the node)."""
    from launcher.plan import timing

    job = compose_job(["recipe=deepseek_v3", "train.recompute=none", "train.recompute_modules=[]",
                       "train.activation_offload_modules=[expert_fc1,moe_act]"])
    lay = derive(job)
    shared = step_time(job, lay).breakdown_s["offload"]
    monkeypatch.setattr(timing, "_dispatch_network_bytes", lambda *a: 0.0)
    alone = step_time(job, lay).breakdown_s["offload"]
    assert shared > alone and shared > 1.0, (shared, alone)


@pytest.mark.parametrize("field,typed,meant,extra", [
    ("train.activation_offload_modules", "[CORE_ATTN,moe_act]", "[core_attn,moe_act]", []),
    ("train.activation_offload_modules", "[core_atn,moe_act]", "[core_attn,moe_act]", []),
    ("train.activation_offload_modules", "[Expert_FC1,moe_act]", "[expert_fc1,moe_act]", []),
    ("train.recompute_modules", "[Core_Attn,layernorm]", "[core_attn,layernorm]",
     ["train.recompute=selective", "precision.fp8=tensorwise"]),
    ("train.cuda_graph_modules", "[ATTN,moe_routr]", "[attn,moe_router]", ["train.cuda_graph_impl=transformer_engine"]),
])
def test_a_misspelled_module_is_hinted_as_the_module_meant(field, typed, meant, extra):
    """The module lists (offload, recompute, CUDA graphs): another case or a typo is answered with the list it was
    probably meant as (the hint validates, as every hint), before the list without it."""
    job = compose_job(MOE + [f"{field}={typed}", *extra])
    [problem] = [p for p in errors(validate(job)) if p.field == field]
    assert problem.hint.startswith(f"{field}={meant}"), problem.hint
